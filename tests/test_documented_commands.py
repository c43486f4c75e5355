"""Every ftjob command the docs show composes: each ``python -m ftjob ...`` / ``ftjob ...`` in
README.md, docs/ and examples/ (code blocks, inline code, scripts, manifests and the commands
their comments give) is checked as ``python -m ftjob`` checks it before Ray starts -- composed
and validated, a sweep (``-m``) once per swept value -- so the docs cannot drift from the
config. A command the docs show failing (the line after it starts ``ftjob: config error:``)
must fail with that line. So does every key the prose of README.md and docs/ sets in inline
code (`trainer.exact=true`, `resume=auto`, `logger=csv|tensorboard`): each composes, and a key
written without its group (`straggler.action=restart` for `failure.straggler.action`) is
named with the key to write. Nothing is run, and no storage or cluster is touched: the check
only composes and validates (an ``s3://bucket/...`` in a command is a string here)."""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ftjob.cli.main import precheck, spell_argv, split_args
from ftjob.config import ConfigError, load_job, register_schema
from ftjob.config.compose import Composer, Target, override_key, spell_groups, sweep_values

ROOT = Path(__file__).resolve().parent.parent
ERROR = "ftjob: config error: "
# How a shell line starts an ftjob command (after VAR=value assignments, or after `--` of
# `ray job submit ... --`).
LAUNCHERS = (
    ("python", "-m", "ftjob"),
    ("python3", "-m", "ftjob"),
    (".venv/bin/python", "-m", "ftjob"),
    ("ftjob",),
)
# Stand-ins for the placeholders the docs write, as a user would fill them in.
STAND_INS = {"HEAD_IP": "10.0.0.1", "$head_ip": "10.0.0.1", "$port": "6379"}
# Commands that show a shape, not a command to run (the key names are placeholders).
SHAPES = {("-m", "KEY=a,b", "OTHER=x,y")}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    args: tuple[str, ...]  # what follows `ftjob`
    env: tuple[tuple[str, str], ...] = ()
    error: str | None = None  # the config error the docs show it ending with


def ftjob_words(line: str) -> tuple[list[str], dict[str, str]] | None:
    """The arguments of the ftjob command ``line`` runs, and its environment; None if it runs
    none. Stops at a shell operator; ``# comment`` dropped."""
    for old, new in STAND_INS.items():
        line = line.replace(old, new)
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if "--" in words:  # ray job submit ... -- python -m ftjob ...
        words = words[words.index("--") + 1 :]
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    for launcher in LAUNCHERS:
        if tuple(words[: len(launcher)]) == launcher:
            args = words[len(launcher) :]
            cut = next((i for i, w in enumerate(args) if w in ("&", "&&", "|", ";")), len(args))
            return args[:cut], env
    return None


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) with continuation lines joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def from_lines(where: str, lines: list[tuple[int, str]]) -> list[Command]:
    found = []
    for i, (number, line) in enumerate(lines):
        words = ftjob_words(line.removeprefix("$ ").strip())
        if words is None:
            continue
        following = lines[i + 1][1].strip() if i + 1 < len(lines) else ""
        error = following.removeprefix(ERROR) if following.startswith(ERROR) else None
        args, env = words
        found.append(Command(f"{where}:{number}", tuple(args), tuple(env.items()), error))
    return found


def markdown_commands(path: Path) -> list[Command]:
    """Fenced code blocks line by line, inline code span by span."""
    where = str(path.relative_to(ROOT))
    found: list[Command] = []
    block: list[tuple[int, str]] | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is not None:
                joined = shell_lines("\n".join(text for _, text in block))
                found += from_lines(where, [(block[0][0] + n - 1, t) for n, t in joined])
            block = [] if block is None else None
        elif block is not None:
            block.append((number, line))
        else:
            for span in re.findall(r"`([^`]+)`", line):
                found += from_lines(where, [(number, span)])
    return found


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """The file's comments as lines of their own (``#   python -m ftjob ...``), joined."""
    lines = path.read_text().splitlines()
    return shell_lines("\n".join(line.split("#", 1)[1] if "#" in line else "" for line in lines))


def script_commands(path: Path) -> list[Command]:
    """A script's commands, and those its comments give."""
    where = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in lines)
    return from_lines(where, shell_lines(code)) + from_lines(where, comment_lines(path))


def manifest_commands(path: Path) -> list[Command]:
    """The commands a manifest's comments give, and its string values that run ``python -m
    ftjob`` (a RayJob's entrypoint)."""
    where = str(path.relative_to(ROOT))
    found = from_lines(where, comment_lines(path))

    def strings(node: object) -> list[str]:
        if isinstance(node, dict):
            return [s for value in node.values() for s in strings(value)]
        if isinstance(node, list):
            return [s for value in node for s in strings(value)]
        return [node] if isinstance(node, str) and "-m ftjob" in node else []

    for document in yaml.safe_load_all(path.read_text()):
        for value in strings(document):
            found += from_lines(f"{where} (value)", [(0, value)])
    return found


def documented_commands() -> list[Command]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths += sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())
    found: list[Command] = []
    for path in paths:
        if path.suffix == ".md":
            found += markdown_commands(path)
        elif path.suffix in (".sh", ".sbatch"):
            found += script_commands(path)
        elif path.suffix == ".yaml":
            found += manifest_commands(path)
    return found


COMMANDS = documented_commands()
# One check per distinct command: many docs show the same one.
DISTINCT = sorted(
    {(c.args, c.env, c.error): c for c in COMMANDS if c.args not in SHAPES}.values(),
    key=lambda c: c.where,
)


def test_the_docs_show_commands_and_their_errors() -> None:
    """The parser finds what the docs hold (a parser that found nothing would pass anything)."""
    places = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/config.md", "examples/existing_cluster.md"} <= places
    assert any(c.where.startswith("examples/slurm/") for c in COMMANDS)
    assert any(c.where.startswith("examples/kuberay/rayjob.yaml (value)") for c in COMMANDS)
    assert any(c.error for c in COMMANDS) and any("-m" in c.args for c in COMMANDS)
    assert ("experiment=imagenet_resnet50",) == next(
        c.args[:1] for c in COMMANDS if c.where.startswith("examples/kuberay/rayjob.yaml (value)")
    )


def check_with_cli(command: Command) -> None:
    """Exactly as ``python -m ftjob`` checks it (for the errors the docs show)."""
    try:
        precheck(spell_argv(list(command.args)))
    finally:
        GlobalHydra.instance().clear()


@functools.cache
def selected(config_dir: str | None, selection: tuple[str, ...]) -> DictConfig:
    """The config a selection of options (groups, experiment, sweep preset, Hydra's own keys)
    composes to, with Hydra's config: composed once for every command that selects it."""
    composer = Composer(config_dir)
    try:
        return composer.compose(Target("docs"), composer.spelled(selection), hydra=True)
    finally:
        GlobalHydra.instance().clear()


@functools.lru_cache(maxsize=1)
def group_names() -> frozenset[str]:
    """Groups an override selects an option of (ftjob's, Hydra's own, the sweep presets)."""
    choices = selected(None, ()).hydra.runtime.choices
    return frozenset(str(group) for group in choices) | {"sweep"}


def with_values(base: DictConfig, values: list[str]) -> None:
    """``values`` (key=value overrides) applied to a copy of ``base`` as Hydra applies them
    after composing, and the job validated as ``python -m ftjob`` validates it."""
    cfg = base.copy()
    ConfigLoaderImpl._apply_overrides_to_config(
        OverridesParser.create().parse_overrides(values), cfg
    )
    with open_dict(cfg):
        del cfg["hydra"]
    load_job(cfg)


def check(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``python -m ftjob`` checks before Ray starts: the command composes and validates,
    and with ``-m`` (or a sweep preset) so does every swept value. The options it selects are
    composed by Hydra (once for all commands that select the same), its key=value overrides
    applied by Hydra's own code; a flag that prints instead of running (``--help``, ``--cfg``)
    is left out, so what it would print composes too."""
    env = dict(command.env)
    if "PYTHONPATH" in env:  # the user's own package, as the command puts it on the path
        for entry in reversed(env["PYTHONPATH"].split(":")):
            monkeypatch.syspath_prepend(str(ROOT / entry))
    flags, overrides = split_args(list(command.args))
    config_dir = str(ROOT / flags["--config-dir"]) if "--config-dir" in flags else None
    groups = group_names()
    overrides = spell_groups(overrides, set(groups) - {"sweep"})  # +experiment= as experiment=
    chosen = [o for o in overrides if override_key(o) in groups]
    values = [o for o in overrides if o not in chosen]
    base = selected(config_dir, tuple(sorted(chosen)))  # Hydra applies them in any order
    multirun = "-m" in flags or base.hydra.mode == RunMode.MULTIRUN
    node = base.hydra.sweeper.get("params") if multirun else None
    params = OmegaConf.to_container(node) if isinstance(node, DictConfig) else None
    swept = sweep_values(params, values)  # type: ignore[arg-type]
    first = [v[0] for v in swept.values.values()] + list(swept.unlisted.values())
    with_values(base, first)
    for key, options in swept.values.items():
        for value in options[1:]:
            with_values(base, [o for o in first if override_key(o) != key] + [value])


@pytest.mark.parametrize("command", DISTINCT, ids=lambda c: c.where)
def test_every_documented_command_composes(command: Command, monkeypatch) -> None:
    if command.error is None:
        check(command, monkeypatch)
        return
    with pytest.raises(ConfigError) as refused:
        check_with_cli(command)
    shown = command.error.removesuffix("...").rstrip()
    assert str(refused.value).startswith(shown), (command.where, str(refused.value))


def test_a_command_the_docs_could_get_wrong_is_caught() -> None:
    """The check is not a formality: a misspelt key, a value out of range, an option that
    does not exist and a bad swept value each fail it."""
    for args in (
        ("experiment=digits_ft", "trainer.epoch=3"),
        ("experiment=digits_ft", "trainer.epochs=-1"),
        ("experiment=digits_fast",),
        ("-m", "experiment=digits_ft", "chaos=worker_killer", "chaos.interval=10,-5"),
    ):
        with pytest.raises((ConfigError, HydraException, OmegaConfBaseException)):
            check(Command("test", args), pytest.MonkeyPatch())


def test_shapes_are_the_only_commands_left_out() -> None:
    left_out = [c for c in COMMANDS if c.args in SHAPES]
    assert len(left_out) == 1 and left_out[0].where.startswith("docs/sweeps.md:"), left_out


# -- keys set in the prose --------------------------------------------------------------------

# An inline span that sets keys: every word an override (`a.b=1`, `+a.b=1`, `++a=x`).
OVERRIDE_WORD = re.compile(r"[+~]{0,2}[A-Za-z_]\w*(?:\.\w+)*=\S+")
# Values the prose writes for "any": a stand-in a key of that kind takes (NAME: every option).
STAND_IN_VALUES = {"N": "2", "...": "x"}
ANY_OPTION = "NAME"
# What the sentence around a key assumes, composed with its span: a resume names its run; a
# node that returns after N steps returns to an elastic group.
CONTEXT = {"resume": ("name=run",), "ray.replace_after_steps": ("trainer.min_workers=1",)}


@dataclass(frozen=True)
class DocumentedKeys:
    where: str  # file:line `span`
    words: tuple[str, ...]  # the span's overrides
    misplaced: tuple[tuple[str, str], ...] = ()  # (key as written, the key it is)


def inline_spans(word: re.Pattern[str] = OVERRIDE_WORD) -> list[tuple[str, str]]:
    """(file:line, span) of every inline code span in README.md and docs/ outside code blocks
    whose words all match ``word`` (overrides, by default)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            for span in [] if fenced else re.findall(r"`([^`]+)`", line):
                words = span.split()
                if words and all(word.fullmatch(w) for w in words):
                    found.append((f"{path.relative_to(ROOT)}:{number}", span))
    return found


@functools.lru_cache(maxsize=1)
def config_paths() -> dict[str, list[str]]:
    """Every key of the composed config (each group with every option, experiments included),
    by its last parts: ``straggler.action`` -> [``failure.straggler.action``]."""
    full: set[str] = set()

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                full.add(f"{prefix}{key}")
                walk(value, f"{prefix}{key}.")

    walk(OmegaConf.to_container(selected(None, ())), "")
    by_tail: dict[str, list[str]] = {}
    for key in full:
        parts = key.split(".")
        for i in range(1, len(parts)):
            by_tail.setdefault(".".join(parts[i:]), []).append(key)
    return by_tail


def documented_keys() -> list[DocumentedKeys]:
    """The spans that set ftjob's keys: a word whose first part is a group, a top-level key or
    ``hydra`` is a key; a dotted word that is the tail of a key is that key, misplaced; a span
    with any other word (`torch.backends.cudnn.deterministic=True`, `CUBLAS_...=...`) or a
    placeholder key (`group.key=value`) is not about ftjob's config."""
    register_schema()  # collected before the session's fixtures register it
    roots = set(group_names()) | set(selected(None, ()).keys()) | {"hydra"}
    found = []
    for where, span in inline_spans():
        words, misplaced = span.split(), []
        keys = [override_key(w) for w in words]
        for key in keys:
            if key.split(".")[0] not in roots and "." in key and key in config_paths():
                misplaced.append((key, " or ".join(sorted(config_paths()[key]))))
        if misplaced or all(k.split(".")[0] in roots for k in keys):
            found.append(DocumentedKeys(f"{where} `{span}`", tuple(words), tuple(misplaced)))
    return found


def spelled_out(words: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The commands a span stands for: `a=x|y` is two, `experiment=NAME` one per experiment,
    `ray.local_nodes=N` a number; `hydra.launcher.*` keys are the ftjob launcher's."""
    commands: list[tuple[str, ...]] = [()]
    for word in words:
        key, value = word.split("=", 1)
        if value == ANY_OPTION:
            try:
                values = Composer().group_options(override_key(key))
            finally:
                GlobalHydra.instance().clear()
        else:
            values = [STAND_IN_VALUES.get(v, v) for v in value.split("|")]
        commands = [(*c, f"{key}={v}") for c in commands for v in values]
    keys = [override_key(w) for w in words]
    if any(key.startswith("hydra.launcher.") for key in keys):
        commands = [(*c, "hydra/launcher=ftjob") for c in commands]
    context = [o for key in keys for o in CONTEXT.get(key, ()) if override_key(o) not in keys]
    return [(*context, *c) for c in commands]


def with_an_option(args: tuple[str, ...]) -> list[tuple[str, ...]]:
    """``args``, and where a key belongs to options of its group other than the default
    (`dataset.bad_files` is imagefolder's and parquet's), ``args`` with each such option."""
    chosen = {override_key(a) for a in args}
    groups = [k.split(".")[0] for k in chosen if "." in k and k.split(".")[0] in group_names()]
    group = next((g for g in groups if g not in chosen), None)
    if group is None:
        return [args]
    try:
        options = Composer().group_options(group)
    finally:
        GlobalHydra.instance().clear()
    return [args] + [(f"{group}={option}", *args) for option in options]


DOCUMENTED_KEYS = documented_keys()


def test_the_docs_prose_sets_keys() -> None:
    """The reader finds what the prose holds (one that found nothing would pass anything)."""
    spans = {k.where.split("`")[1] for k in DOCUMENTED_KEYS}
    assert {
        "trainer.exact=true",
        "resume=auto",
        "logger=csv|tensorboard|mlflow|wandb|many",
    } <= spans
    assert not any(k.where.split("`")[1].startswith("torch.") for k in DOCUMENTED_KEYS)


def test_every_key_the_docs_set_is_written_in_full() -> None:
    """A key set (`straggler.action=restart`) or named (`hang.timeout`) without its group is
    one a user cannot type as written."""
    wrong = [f"{k.where}: {key} is {full}" for k in DOCUMENTED_KEYS for key, full in k.misplaced]
    roots = set(group_names()) | set(selected(None, ()).keys()) | {"hydra"}
    for where, key in inline_spans(re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")):
        if key.split(".")[0] not in roots and key in config_paths():
            wrong.append(f"{where} `{key}`: {key} is {' or '.join(config_paths()[key])}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("keys", DOCUMENTED_KEYS, ids=lambda k: k.where)
def test_every_key_the_docs_set_composes(keys: DocumentedKeys, monkeypatch) -> None:
    """Composed and validated as `python -m ftjob` would take the span's words; a rule about
    a key the span does not set (`resume=true` needs a `name=`) is the sentence's context,
    not the span's error."""
    if keys.misplaced:
        pytest.skip("misplaced: reported by test_every_key_the_docs_set_is_written_in_full")
    for args in spelled_out(keys.words):
        errors: list[Exception] = []
        for candidate in with_an_option(args):
            try:
                check(Command(keys.where, candidate), monkeypatch)
                break
            except ConfigError as refused:
                if all(override_key(w) != refused.key for w in keys.words):
                    break  # a key the sentence leaves to its reader (dataset.path)
                errors.append(refused)
            except (HydraException, OmegaConfBaseException) as refused:
                errors.append(refused)
        else:
            raise errors[0]


# -- the README's set-up ----------------------------------------------------------------------


def readme_block(section: str) -> list[str]:
    """The command lines of the first code block under README.md's ``## section``."""
    text = (ROOT / "README.md").read_text().split(f"\n## {section}\n", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_set_up_is_two_commands_and_ci_runs_its_test_command() -> None:
    """Install from a clone (ftjob is on no index yet), then ``ftjob``; the test command is
    the one ``.ci/run`` ends with, in the environment the install made."""
    install, run = readme_block("Install and run")
    [test] = readme_block("Test")
    assert "pip install ftjob" not in install and 'pip install -e ".[test]"' in install
    assert install.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert run == "ftjob" and test.startswith(".venv/bin/python -m pytest ")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci[-1] == test and '.venv/bin/pip install -q -e ".[test]"' in ci
