"""What every schema rule stands on: the error a broken rule raises and the helpers that phrase
it, so that each message names the full key, the value and the rule in one line."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A config value breaks a rule. ``str()`` is one line: key, value, rule. ``supply``: the
    value is one the user must give at run time (``python -m ftjob.check`` reports it as
    "needs", not as an error of the config file)."""

    def __init__(self, key: str, value: Any, rule: str, supply: bool = False) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        self.supply = supply
        super().__init__(f"{key}={value!r}: {rule}")


class JobError(RuntimeError):
    """The job cannot run as configured (on this cluster, with this data); the message says
    what to change."""


def require(ok: bool, group: str, key: str, value: Any, rule: str) -> None:
    """Raise :class:`ConfigError` for ``group.key`` (``key`` alone when ``group`` is empty)
    unless ``ok``."""
    if not ok:
        raise ConfigError(f"{group}.{key}" if group else key, value, rule)


def at_least(config: Any, key: str, minimum: float, note: str = "") -> None:
    """``config.key >= minimum``; ``config._group`` names the key's group."""
    value = getattr(config, key)
    require(value >= minimum, config._group, key, value, f"must be >= {minimum:g}{note}")


def refuse_non_finite(config: Any, prefix: str = "") -> None:
    """Every number of the schema is finite: ``inf`` passes every ``>= x`` rule, then overflows
    a timer (a lease renewal thread dies on it) or an allocation; ``nan`` passes none and
    compares false everywhere. Where "no limit" is meant, a key takes null."""
    for f in fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            refuse_non_finite(value, f"{key}.")
        elif f.type == "dict[str, float]":
            for name, amount in value.items():
                _require_finite(f"{key}.{name}", amount)
        else:
            _require_finite(key, value)


def _require_finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number (null where a key means no limit)")


def is_placeholder(value: Any) -> bool:
    """A ``<...>`` value that ``python -m ftjob.check`` stands in for a ``???`` one: the rules
    that need the real value leave it to run time."""
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")
