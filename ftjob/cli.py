"""Command line: ``python -m ftjob [hydra overrides]`` and ``-m`` sweeps.

Before Hydra runs a job, :func:`precheck` composes the same config through Hydra's compose API
and validates it, so an unknown key, a wrong type or an invalid value stops the command in
seconds with one line naming the key and the rule (for a sweep, every swept value is checked
before the first job starts). Then Hydra takes over as usual: run dir, ``.hydra/``, sweeps.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ftjob.config import ConfigError, load_job, register_schema

CONFIG_MODULE = "ftjob.conf"
CONFIG_NAME = "config"
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
        elif arg in _VALUE_FLAGS and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            flags[arg] = argv[i + 1]
            i += 1
        elif arg.startswith("-"):
            flags[arg] = True
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def _compose(overrides: list[str], config_name: str) -> Any:
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def _explain(exc: Exception, overrides: list[str]) -> ConfigError:
    """One ConfigError (key, value, rule) from a Hydra/OmegaConf composition error."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else exc
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = lines[0] if lines else type(exc).__name__
    given = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    key = getattr(cause, "full_key", None)
    missing = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", head)
    if missing:
        group, option = missing.groups()
        return ConfigError(
            group.split("/")[-1],
            option,
            f"no such config '{group}/{option}' (see conf/{group}/ for the options)",
        )
    unknown = re.search(r"Could not override '([^']+)'", head)
    if unknown and not key:
        key = unknown.group(1)
    detail = next((line for line in str(cause).splitlines() if line.strip()), head).strip()
    if key is None:
        return ConfigError("config", " ".join(overrides), head)
    if "not in" in detail or "not in struct" in detail:
        rule = f"unknown key ({detail}); check the spelling, or see the keys with --cfg job"
    else:
        rule = detail
    return ConfigError(key, given.get(key), rule)


def _check_one(overrides: list[str], config_name: str) -> None:
    try:
        cfg = _compose(overrides, config_name)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _explain(exc, overrides) from None
    load_job(cfg)


def precheck(argv: list[str]) -> None:
    """Raise ConfigError (one line) if the command's config, or any swept value, is invalid."""
    flags, overrides = split_args(argv)
    if any(flag in _NO_RUN_FLAGS for flag in flags) or "--config-path" in flags or "-cp" in flags:
        return
    config_dir = flags.get("--config-dir") or flags.get("-cd")
    config_name = flags.get("--config-name") or flags.get("-cn") or CONFIG_NAME
    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    if config_dir:
        job_overrides.append(f"hydra.searchpath=[file://{os.path.abspath(config_dir)}]")
    multirun = "-m" in flags or "--multirun" in flags
    parsed = OverridesParser.create().parse_overrides(job_overrides)
    sweeps = {
        i: list(o.sweep_string_iterator())
        for i, o in enumerate(parsed)
        if multirun and o.is_sweep_override()
    }
    first = [
        f"{o.get_key_element()}={sweeps[i][0]}" if i in sweeps else job_overrides[i]
        for i, o in enumerate(parsed)
    ]
    _check_one(first, config_name)
    for i, values in sweeps.items():
        for value in values[1:]:
            combo = list(first)
            combo[i] = f"{parsed[i].get_key_element()}={value}"
            _check_one(combo, config_name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    register_schema()
    try:
        precheck(argv)
    except ConfigError as exc:
        print(f"ftjob: config error: {exc}", file=sys.stderr)
        return 2
    finally:
        GlobalHydra.instance().clear()
    from ftjob.app import run_hydra

    return run_hydra(argv)
