"""Command line: ``python -m ftjob [hydra overrides]`` and ``-m`` sweeps.

Before Hydra runs a job, :func:`precheck` composes the same config through Hydra's compose API
and validates it, so an unknown key, a wrong type or an invalid value stops the command in
seconds with one line naming the key and the rule (for a sweep, every swept value is checked
before the first job starts). Then Hydra takes over as usual: run dir, ``.hydra/``, sweeps.
``--cfg job|hydra|all`` is checked the same way and printed by ftjob, without secrets
(:mod:`ftjob.cli.show_config`); ``--version`` is ftjob's.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Callable
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

import ftjob
from ftjob.cli.show_config import KINDS, config_text
from ftjob.config import ConfigError, load_job, plain_mapping, register_schema
from ftjob.config.compose import (
    PRIMARY_CONFIG,
    Composer,
    Target,
    expose_hydra_plugins,
    override_key,
    parse_overrides,
    sweep_values,
)
from ftjob.config.secrets import Redactor, guard_logging

# Flags after which Hydra does not run the job: nothing to precheck.
_NO_RUN_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--resolve",
    "--shell-completion",
    "-sc",
}
_VALUE_FLAGS = {
    "--config-dir",
    "-cd",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--experimental-rerun",
}


# What --info answers (Hydra's choices; none: all).
_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def split_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Hydra flags (with values) and overrides."""
    flags: dict[str, Any] = {}
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-") and "=" in arg and arg.split("=", 1)[0] in _VALUE_FLAGS:
            key, value = arg.split("=", 1)
            flags[key] = value
        elif arg in ("--info", "-i") and (i + 1 == len(argv) or argv[i + 1] not in _INFO):
            flags[arg] = True  # its value is optional: what follows is an override
        elif arg in _VALUE_FLAGS and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            flags[arg] = argv[i + 1]
            i += 1
        elif arg.startswith("-"):
            flags[arg] = True
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def _explain(
    exc: Exception, overrides: list[str], options: Callable[[str], list[str]] | None = None
) -> ConfigError:
    """One ConfigError (key, value, rule) from a Hydra/OmegaConf composition error."""
    # An error in a config file: Hydra raises its own while handling OmegaConf's (the context).
    inner = exc.__cause__ or exc.__context__
    cause = inner if isinstance(inner, OmegaConfBaseException) else exc
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    given = parse_overrides(overrides)
    key = getattr(cause, "full_key", None)
    missing = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", head)
    if missing:
        group, option = missing.groups()
        try:
            known = ", ".join(options(group)) if options else ""
        except (HydraException, OmegaConfBaseException, OSError):  # a courtesy: the error stands
            known = ""
        return ConfigError(
            group.split("/")[-1],
            option,
            f"no such {group} option; the options are: {known}"
            if known
            else f"no such config '{group}/{option}'",
        )
    unknown = re.search(r"Could not override '([^']+)'", head)
    if unknown and not key:
        key = unknown.group(1)
    detail = next((line for line in str(cause).splitlines() if line.strip()), head).strip()
    # A group missing from the defaults list: Hydra's own way out ("To append to your default
    # list use +experiment=NAME") stays in the line.
    hint = next((line for line in lines if line.startswith("To append")), None)
    if hint and "No match in the defaults list" in detail:
        detail = f"{detail} {hint}"
    if key is None:
        return ConfigError("config", " ".join(overrides), head)
    if "is not in struct" in detail:  # a new key in a dict-valued key, e.g. resources_per_worker
        rule = f"not a key yet ({detail}); to add it write +{key}=VALUE, or set the whole dict with ++{key.rsplit('.', 1)[0]}={{...}}"
    elif "not in" in detail:
        rule = f"unknown key ({detail}); check the spelling, or see the keys with --cfg job"
    else:
        rule = detail
    if key not in given:  # a key under an unknown one (trainr.epochs=3): what was typed
        key = next((k for k in given if k.startswith(f"{key}.")), key)
    return ConfigError(key, given[key] if key in given else getattr(cause, "value", None), rule)


# Groups a bare word on the command line may be an option of, in the order they are offered.
_WORD_GROUPS = ("experiment", "model", "dataset", "optimizer", "chaos", "logger", "sweep")


def _unparsable(
    exc: HydraException, overrides: list[str], options: Callable[[str], list[str]]
) -> ConfigError:
    """One line for an argument Hydra cannot parse as an override: which one, Hydra's reason,
    and -- for a bare word that names a group's option -- the override it likely meant."""
    text = str(exc)
    quoted = re.search(r"Error parsing override '(.*)'", text)
    bad = (
        quoted.group(1)
        if quoted
        else next((o for o in overrides if not _parses(o)), " ".join(overrides))
    )
    reason = next(
        (
            line.strip()
            for line in text.splitlines()
            if line.strip() and not line.startswith("Error parsing") and "hydra.cc" not in line
        ),
        "unreadable",
    )
    rule = f"not an override (Hydra: {reason}); write name=value (trainer.epochs=10)"
    if "=" not in bad:
        for group in _WORD_GROUPS:
            try:
                found = bad in options(group)
            except (HydraException, OmegaConfBaseException, OSError):  # a courtesy
                found = False
            if found:
                spelled = f"+{group}={bad}" if group == "sweep" else f"{group}={bad}"
                rule = rule.replace("(trainer.epochs=10)", f"(here: {spelled})")
                break
    return ConfigError("argument", bad, rule)


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True


def _command_target(flags: dict[str, Any]) -> tuple[Composer, Target]:
    """The composer and the primary config a command composes (``--config-dir``/``-cn``)."""
    config_dir = flags.get("--config-dir") or flags.get("-cd")
    config_name = flags.get("--config-name") or flags.get("-cn") or PRIMARY_CONFIG
    primary = os.path.join(config_dir, f"{config_name}.yaml") if config_dir else None
    user_primary = primary is not None and os.path.exists(primary)
    target = Target("command line", config_name=config_name, user_primary=user_primary)
    return Composer(config_dir), target


def spell_argv(argv: list[str]) -> list[str]:
    """The command line with ``+experiment=NAME`` as ``experiment=NAME`` where the primary
    config has ``experiment`` in its defaults list (ftjob's does, with a null default): both
    spellings choose an experiment. Unchanged when the primary config cannot be read (the
    precheck then says why) or comes from ``--config-path``."""
    flags, overrides = split_args(argv)
    if not any(o.startswith("+") for o in overrides) or "--config-path" in flags or "-cp" in flags:
        return argv
    composer, target = _command_target(flags)
    try:
        spelled = dict(zip(overrides, composer.spelled(overrides, target), strict=True))
    except (HydraException, OmegaConfBaseException, OSError):
        return argv
    finally:
        GlobalHydra.instance().clear()
    return [spelled.get(arg, arg) for arg in argv]


def shown_config(flags: dict[str, Any]) -> str | None:
    """What ``--cfg`` prints (``job``, ``hydra`` or ``all``) when that is the command; None
    with another command flag (``-m``, ``--help``, ``--info``: Hydra answers, as it does a
    kind it does not know)."""
    kind = flags.get("--cfg", flags.get("-c"))
    others = set(flags) & (_NO_RUN_FLAGS | {"-m", "--multirun"})
    return kind if kind in KINDS and not others - {"--cfg", "-c", "--resolve"} else None


def precheck(argv: list[str]) -> DictConfig | None:
    """Raise ConfigError (one line) if the command's config, or any value it sweeps -- on the
    command line or in a ``+sweep=`` preset's ``hydra.sweeper.params`` -- is invalid. Returns
    the config composed with Hydra's node (a sweep's first combination; for ``--cfg``, the
    overrides as given); None where Hydra composes nothing to run (``--help``, ``--info``) or
    the config comes from ``--config-path``."""
    flags, overrides = split_args(argv)
    showing = shown_config(flags) is not None
    if "--config-path" in flags or "-cp" in flags:
        return None
    if not showing and any(flag in _NO_RUN_FLAGS for flag in flags):
        return None
    composer, target = _command_target(flags)
    if showing:
        return _checked(composer, target, overrides, hydra=True)
    try:
        given = sweep_values(None, overrides)
    except HydraException as exc:  # an argument that is no override (``imagenet_ft``, ``k=[1``)
        raise _unparsable(exc, overrides, lambda g: composer.group_options(g, target)) from None
    first = [values[0] for values in given.values.values()] + list(given.unlisted.values())
    cfg = _checked(composer, target, first, hydra=True)
    multirun = "-m" in flags or "--multirun" in flags or cfg.hydra.mode == RunMode.MULTIRUN
    check_output_dir(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir")
    if multirun:
        swept = sweep_values(plain_mapping(cfg.hydra.sweeper.get("params")), overrides)
        for key, values in swept.values.items():
            for value in values[1:]:  # the first value is in the combination checked above
                _checked(composer, target, [o for o in first if override_key(o) != key] + [value])
    return cfg


def _checked(
    composer: Composer, target: Target, overrides: list[str], hydra: bool = False
) -> DictConfig:
    """``overrides`` composed and the job validated (ConfigError: one line)."""
    try:
        cfg = composer.compose(target, overrides, hydra=hydra)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _explain(exc, overrides, lambda g: composer.group_options(g, target)) from None
    job = cfg.copy()
    if hydra:
        with open_dict(job):
            del job["hydra"]
    load_job(job)
    return cfg


def check_output_dir(cfg: DictConfig, key: str) -> None:
    """The directory Hydra makes for the run (``hydra.run.dir``; a sweep's ``hydra.sweep.dir``)
    can be made, or is a directory this user may write in: Hydra's own failure is a traceback
    ending in "Set the environment variable HYDRA_FULL_ERROR=1". A value that does not resolve
    here is left to Hydra."""
    try:
        path = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return
    why = cannot_make_dir(str(path)) if path else None
    if why is not None:
        raise ConfigError(key, str(path), f"{why}: choose a directory you may create ({key}=DIR)")


def cannot_make_dir(path: str) -> str | None:
    """Why ``path`` cannot be made a directory this user writes in, or None."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if not os.path.isdir(target):
            return "it exists and is not a directory"
        return None if os.access(target, os.W_OK | os.X_OK) else "this user may not write in it"
    parent = os.path.dirname(target)
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory, so nothing can be made under it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"this user may not create it in {parent}"
    return None


def version_line() -> str:
    """``ftjob --version``: ftjob's version, and those of what it runs on (read from their
    installed metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [f"Python {platform.python_version()}"]
    for dist, label in (("hydra-core", "Hydra"), ("ray", "Ray"), ("torch", "torch")):
        try:
            parts.append(f"{label} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{label} not installed")
    return f"ftjob {ftjob.__version__} ({', '.join(parts)})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = split_args(argv)[0]
    if "--version" in flags:  # Hydra's own flag prints Hydra's version
        print(version_line())
        return 0
    info = flags.get("--info", flags.get("-i"))
    if info in (True, "all", "config"):  # Hydra would print the composed config in the clear
        print(
            f"ftjob: --info {'all' if info is True else info} prints the composed config with "
            "its secrets in the clear: see it checked and redacted with --cfg job (--cfg all "
            "for Hydra's part too); --info searchpath, defaults, defaults-tree and plugins "
            "answer as Hydra does",
            file=sys.stderr,
        )
        return 2
    register_schema()
    expose_hydra_plugins()  # before Hydra's plugin scan: hydra/launcher=ftjob
    # The command line's secrets, before any config is composed: out of the config-error line
    # and of every log record (a launcher logs the sweep's overrides before any job starts).
    redactor = Redactor.for_overrides(split_args(argv)[1])
    guard_logging(redactor)
    try:
        argv = spell_argv(argv)
        cfg = precheck(argv)
        kind = shown_config(flags)
        if kind is not None and cfg is not None:  # --cfg: printed by ftjob, without secrets
            package = flags.get("--package") or flags.get("-p")
            text, code = config_text(cfg, kind, package, "--resolve" in flags, redactor)
            sys.stdout.write(text)
            return code
    except ConfigError as exc:
        print(f"ftjob: config error: {redactor.text(str(exc))}", file=sys.stderr)
        return 2
    finally:
        GlobalHydra.instance().clear()
    from ftjob.cli.app import run_hydra

    return run_hydra(argv)
