"""Keys spelled the way earlier versions did: they still work, moved to where they live now,
with one line on stderr that names the new key, and stay out of the config a user reads
(``--cfg job``)."""

from __future__ import annotations

import sys
from typing import Any

# Flat failure.* keys of earlier versions -> where they live now (under ``failure``).
RENAMED_FAILURE_KEYS = {
    "hang_detection": "hang.enabled",
    "hang_timeout": "hang.timeout",
    "hang_safety_factor": "hang.safety_factor",
    "hang_min_timeout": "hang.min_timeout",
    "hang_max_timeout": "hang.max_timeout",
    "hang_warmup": "hang.warmup",
    "heartbeat_interval": "hang.heartbeat_interval",
    "straggler_threshold": "straggler.threshold",
    "straggler_patience": "straggler.patience",
    "straggler_action": "straggler.action",
    "restart_loop_attempts": "restart_loop.attempts",
    "restart_loop_min_steps": "restart_loop.min_steps",
}
_said: set[str] = set()


def say_deprecated(old: str, new: str) -> None:
    """One line on stderr, once per process, for a key spelled the old way."""
    if old not in _said:
        _said.add(old)
        print(f"ftjob: {old} is deprecated: it is {new} now", file=sys.stderr)


def move_renamed_failure_keys(failure: Any) -> None:
    """Move each old-spelled key of ``failure`` (a FailureConfig) that was given (not null) to
    its new home, say so, and apply the new home's value rules to the values moved there."""
    moved_to = set()
    for old, new in RENAMED_FAILURE_KEYS.items():
        value = getattr(failure, old)
        if value is None:
            continue
        section, key = new.split(".")
        setattr(getattr(failure, section), key, value)
        setattr(failure, old, None)
        moved_to.add(section)
        say_deprecated(f"{failure._group}.{old}", f"{failure._group}.{new}")
    for section in moved_to:
        getattr(failure, section).__post_init__()


def without_renamed_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A plain job config (``--cfg job``'s) as a user reads it: the old spellings hold null in
    the schema -- so that an override or a config file may still give them -- and would list
    a dozen keys no one set; each one given is shown at its new home, the rest left out."""
    failure = config.get("failure")
    if not isinstance(failure, dict):
        return config
    failure = dict(failure)
    for old, new in RENAMED_FAILURE_KEYS.items():
        value = failure.pop(old, None)
        if value is None:
            continue
        section, key = new.split(".")
        if isinstance(failure.get(section), dict):
            failure[section] = {**failure[section], key: value}
    return {**config, "failure": failure}
