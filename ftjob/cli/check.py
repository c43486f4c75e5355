"""``python -m ftjob.check [--config-dir DIR [--only-config-dir]]``: review configs as code, as a
repo's CI would. (``python -m ftjob.check --data OVERRIDES``: the job's data instead, every file
decoded up front: :mod:`ftjob.cli.check_data`.)

Composes the default config, every option of every config group, every experiment
(``+experiment=NAME``) and every sweep preset (``+sweep=NAME``, once per combination of its
``hydra.sweeper.params`` values), and validates each with :func:`ftjob.config.load_job`:
types, unknown keys, value rules, ``_target_`` importable with its keys bound to the
signature, cross-field rules. Nothing is instantiated and Ray is not started, so a full check
takes seconds. ``--config-dir`` adds a user's own config dir to Hydra's search path (as
``python -m ftjob --config-dir DIR`` does) and checks its files too; ``--only-config-dir`` checks
its files alone (each still composed with ftjob's conf).

One line per file: ``ok``, ``needs`` (a ``???`` value the user supplies at run time, like
imagenet_ft's dataset.path: reported, not a failure) or ``ERROR file: key=value: rule``.
Exit 1 if any file has an error, 2 if the command itself is wrong, else 0.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ftjob.cli.check_data import check_data
from ftjob.config import (
    TARGET_GROUPS,
    ConfigError,
    check_group_target,
    load_job,
    plain_mapping,
    register_schema,
)
from ftjob.config import check_target as config_check_target
from ftjob.config.compose import CONFIG_MODULE, JOB, SWEEP, Composer, Target, sweep_values

EXPERIMENT_GROUP = "experiment"
SWEEP_GROUP = "sweep"
# Config groups that configure Hydra itself, not the job: not composed as job options.
SKIPPED_GROUPS = ("hydra",)
# Stands in for a `???` value so the rest of the config is still validated.
PLACEHOLDER = "<supplied at run time>"

OK, NEEDS, ERROR = "ok", "needs", "ERROR"


@dataclass(frozen=True)
class Verdict:
    target: Target
    status: str  # ok | needs | ERROR
    detail: str = ""

    def line(self) -> str:
        return f"{self.status:<6} {self.target.label}" + (f": {self.detail}" if self.detail else "")


# -- finding the configs -------------------------------------------------------------------


def _yaml_files(folder: Traversable | Path) -> list[Traversable | Path]:
    return sorted(
        (f for f in folder.iterdir() if f.is_file() and f.name.endswith(".yaml")),
        key=lambda f: f.name,
    )


def _group_dirs(
    root: Traversable | Path, prefix: str = ""
) -> Iterator[tuple[str, Traversable | Path]]:
    """(group path, folder) for every config group below ``root``, nested groups included."""
    for child in sorted(root.iterdir(), key=lambda c: c.name):
        if not child.is_dir() or child.name.startswith((".", "_")):
            continue
        group = f"{prefix}{child.name}"
        if group in SKIPPED_GROUPS:
            continue
        yield group, child
        yield from _group_dirs(child, f"{group}/")


def _is_global(option_file: Traversable | Path) -> bool:
    """Does the file start with the `# @package _global_` header (it then sets any key)?"""
    try:
        head = option_file.read_text().lstrip().splitlines()[:1]
    except (OSError, UnicodeDecodeError):
        return False
    return bool(head) and head[0].replace(" ", "") == "#@package_global_"


def _option_target(
    label: str, group: str, option_file: Traversable | Path, default_groups: set[str]
) -> Target:
    option = option_file.name.removesuffix(".yaml")
    # Groups in the primary config's defaults list are replaced; others (experiment, sweep,
    # a user's new group) are added.
    override = f"{group}={option}" if group in default_groups else f"+{group}={option}"
    if group == SWEEP_GROUP:
        scope = SWEEP
    elif group == EXPERIMENT_GROUP or _is_global(option_file):
        scope = JOB
    else:
        scope = group.replace("/", ".")
    return Target(label, (override,), scope=scope, group=group)


def find_targets(
    root: Traversable | Path, label_prefix: str, default_groups: set[str], user_dir: bool = False
) -> list[Target]:
    """Every config under ``root``: top-level files are primary configs, files in group
    folders are options of that group."""
    targets = [
        Target(
            f"{label_prefix}{f.name}",
            config_name=f.name.removesuffix(".yaml"),
            user_primary=user_dir,
        )
        for f in _yaml_files(root)
    ]
    for group, folder in _group_dirs(root):
        for f in _yaml_files(folder):
            label = f"{label_prefix}{group}/{f.name}"
            targets.append(_option_target(label, group, f, default_groups))
    return targets


# -- composing and validating --------------------------------------------------------------


_DETAIL_NOISE = ("full_key:", "object_type=", "reference_type=", "In '")


def explain_composition_error(exc: Exception) -> str:
    """``key: rule`` from a Hydra/OmegaConf composition error (the key when one is known).
    Hydra flattens OmegaConf's error into its message, so the key is read from there too."""
    cause: BaseException = exc
    while cause.__cause__ is not None and not getattr(cause, "full_key", None):
        cause = cause.__cause__
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    key = getattr(cause, "full_key", None) or next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None
    )
    details = [line for line in lines if not line.startswith(_DETAIL_NOISE)]
    rule = details[0] if details else (lines[0] if lines else type(cause).__name__)
    return f"{key}: {rule}" if key else rule


def fill_missing(cfg: DictConfig, within: DictConfig | None = None) -> list[str]:
    """The `???` keys of ``within`` (default: all of ``cfg``), as full keys, each set to a
    placeholder where its type allows, so that the rest of the config is still validated."""
    missing = sorted(OmegaConf.missing_keys(cfg if within is None else within))
    for key in missing:
        try:
            OmegaConf.update(cfg, key, PLACEHOLDER, force_add=False)
        except OmegaConfBaseException:
            pass  # a typed field: it stays missing, and validation reports it as missing
    return missing


def _missing_hint(cfg: DictConfig) -> str:
    """What load_job says about the first missing value: the command a user will type."""
    try:
        load_job(cfg.copy())
    except ConfigError as exc:
        if exc.value == "???":
            return f": {exc.rule}"
    return ""


def validate_job(cfg: DictConfig) -> tuple[str, str]:
    """(status, detail) of a whole composed job config."""
    hint = _missing_hint(cfg) if OmegaConf.missing_keys(cfg) else ""
    missing = fill_missing(cfg)
    try:
        load_job(cfg)
    except ConfigError as exc:
        if exc.supply:  # e.g. checkpoint storage on a cluster: the user's bucket
            return NEEDS, ", ".join([*missing, exc.key]) + f" ({exc.rule})"
        if exc.value != "???" or exc.key not in missing:
            return ERROR, str(exc)
    return (NEEDS, ", ".join(missing) + hint) if missing else (OK, "")


def validate_node(cfg: DictConfig, key: str) -> tuple[str, str]:
    """(status, detail) of one group's node: its own types and value rules, or for a
    ``_target_`` node the target's import and signature."""
    node = OmegaConf.select(cfg, key)
    if not isinstance(node, DictConfig):
        return OK, ""
    missing = fill_missing(cfg, node)
    try:
        if "_target_" in node:
            plain = plain_mapping(node)
            if key in TARGET_GROUPS:
                check_group_target(plain, key)
            else:
                config_check_target(plain, key)
        else:
            OmegaConf.to_object(node)  # runs the group dataclass's __post_init__ rules
    except ConfigError as exc:
        return ERROR, str(exc)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            return ERROR, str(cause)
        if not (missing and OmegaConf.missing_keys(node)):
            return ERROR, explain_composition_error(exc)
    return (NEEDS, ", ".join(missing)) if missing else (OK, "")


def validate(cfg: DictConfig, scope: str) -> tuple[str, str]:
    return validate_job(cfg) if scope in (JOB, SWEEP) else validate_node(cfg, scope)


def check_target(composer: Composer, target: Target) -> Verdict:
    # One file's verdict: whatever goes wrong is that file's error, and the others still run.
    try:
        if target.scope == SWEEP:
            return check_sweep(composer, target)
        return Verdict(target, *validate(composer.compose(target, ()), target.scope))
    except (HydraException, OmegaConfBaseException) as exc:
        detail = explain_composition_error(exc)
        if target.group and detail.startswith(f"{target.group}: Key '{target.group}' not in"):
            detail += " (a file applied with +group=... sets global keys: start it with `# @package _global_`)"
        return Verdict(target, ERROR, detail)
    except Exception as exc:  # e.g. yaml.YAMLError: a file that does not parse
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        return Verdict(target, ERROR, f"{type(exc).__name__}: {text}")


def check_sweep(composer: Composer, target: Target) -> Verdict:
    """A sweep preset is as good as its worst combination of swept values."""
    base = composer.compose(target, (), hydra=True)
    params = plain_mapping(base.hydra.sweeper.get("params"))
    if not params:
        return Verdict(
            target, ERROR, "hydra.sweeper.params: a sweep preset must list the values to sweep"
        )
    values = sweep_values(params)
    combos = list(itertools.product(*values.values.values()))
    needs: list[str] = []
    for combo in combos:
        try:
            status, detail = validate_job(composer.compose(target, combo))
        except (HydraException, OmegaConfBaseException) as exc:
            status, detail = ERROR, explain_composition_error(exc)
        if status == ERROR:
            return Verdict(target, ERROR, f"{detail} (with {' '.join(combo)})")
        if status == NEEDS and detail not in needs:
            needs.append(detail)
    scope = f"{len(combos)} combination(s) of {' x '.join(params)}"
    if values.unlisted:
        scope += f"; not enumerated: {', '.join(values.unlisted)}"
    if needs:
        return Verdict(target, NEEDS, f"{'; '.join(needs)} ({scope})")
    return Verdict(target, OK, scope)


def check_all(config_dir: str | None = None, only_config_dir: bool = False) -> list[Verdict]:
    """Verdicts for ftjob's own conf and, if given, a user's config dir (``only_config_dir``:
    for the user's files alone, each still composed with ftjob's conf as a run composes it)."""
    register_schema()
    composer = Composer(config_dir)
    try:
        groups = composer.default_groups()
        targets = [] if only_config_dir else find_targets(files(CONFIG_MODULE), "", groups)
        if config_dir:
            targets += find_targets(
                Path(config_dir), f"{config_dir.rstrip('/')}/", groups, user_dir=True
            )
        return [check_target(composer, t) for t in targets]
    finally:
        GlobalHydra.instance().clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftjob.check",
        description="Compose and validate every config (default, group options, experiments, "
        "sweep presets with each swept value) without running anything.",
    )
    parser.add_argument(
        "--config-dir",
        "-cd",
        help="also check this config dir (added to Hydra's search path, as for python -m ftjob)",
    )
    parser.add_argument(
        "--only-config-dir",
        action="store_true",
        help="check only the files of --config-dir, not ftjob's own (a repo of configs' CI)",
    )
    parser.add_argument(
        "--data",
        action="store_true",
        help="instead: list the job's dataset (OVERRIDES as for python -m ftjob), decode "
        "every file in parallel and list the bad ones (exit 1 if any)",
    )
    parser.add_argument("--jobs", type=int, help="--data: decoding processes (default: cores)")
    parser.add_argument("overrides", nargs="*", help="--data: the job's overrides")
    args = parser.parse_args(argv)
    if args.data:
        return check_data(args.overrides, args.jobs)
    if args.overrides:
        print(
            "ftjob.check: overrides are for --data (the job whose data to check)", file=sys.stderr
        )
        return 2
    if args.only_config_dir and not args.config_dir:
        print("ftjob.check: --only-config-dir needs --config-dir DIR", file=sys.stderr)
        return 2
    if args.config_dir and not os.path.isdir(args.config_dir):
        print(f"ftjob.check: --config-dir {args.config_dir}: no such directory", file=sys.stderr)
        return 2
    verdicts = check_all(args.config_dir, args.only_config_dir)
    if not verdicts:
        print(
            f"ftjob.check: --config-dir {args.config_dir}: no config files in it", file=sys.stderr
        )
        return 2
    for verdict in verdicts:
        print(verdict.line())
    counts = {s: sum(v.status == s for v in verdicts) for s in (OK, NEEDS, ERROR)}
    print(
        f"ftjob.check: {len(verdicts)} configs: {counts[OK]} ok, {counts[NEEDS]} need values "
        f"at run time, {counts[ERROR]} with errors"
    )
    return exit_status(verdicts)


def exit_status(verdicts: Sequence[Verdict]) -> int:
    """1 if any config has an error; a value to supply at run time (needs) is not one."""
    return 1 if any(v.status == ERROR for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
