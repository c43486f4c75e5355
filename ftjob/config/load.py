"""From a composed config to a validated :class:`JobConfig`, and back to plain data.

Hydra composes conf/ against the schema (registered in its ConfigStore as ``ftjob_schema``), so
an unknown key, a wrong type or a word a choice key does not take is refused at composition.
:func:`load_job` refuses the keys composition lets through, builds the dataclasses (each
group's ``__post_init__`` applies its value rules) and checks the ``_target_`` nodes.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from ftjob.config.failure import FailureConfig
from ftjob.config.job import JobConfig
from ftjob.config.legacy import RENAMED_FAILURE_KEYS
from ftjob.config.rules import ConfigError
from ftjob.config.targets import check_job_targets

# Keys whose missing value deserves more than "set it": what a user actually types.
_MISSING_HINTS = {
    "dataset.path": "set dataset.path=/data/imagenet (or s3://bucket/imagenet): a folder with "
    "train/ and val/ class subfolders",
    "name": "set name=RUN_NAME",
    "checkpoint.storage_path": "set checkpoint.storage_path=s3://bucket/prefix (or gs://..., or a "
    "path every node mounts, with checkpoint.shared_filesystem=true)",
}


def load_job(cfg: DictConfig) -> JobConfig:
    """Turn a composed config into a validated JobConfig, or raise ConfigError (one line).
    Imports the ``_target_`` of ``model``, ``dataset`` and ``optimizer`` to check them."""
    try:
        _check_known_keys(cfg, JobConfig)
        job = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except MissingMandatoryValue as exc:
        key = exc.full_key or "?"
        raise ConfigError(
            key, "???", _MISSING_HINTS.get(key, f"is required: set {key}=VALUE")
        ) from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        key = getattr(exc, "full_key", None) or "config"
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(key, _given(cfg, key, getattr(exc, "value", None)), message) from None
    assert isinstance(job, JobConfig)
    check_job_targets(job)
    return job


def _given(cfg: DictConfig, key: str, value: Any) -> Any:
    """``value``, or where it is unknown the text ``key`` holds as written: an interpolation
    that does not resolve (``${oc.env:TOKEN}`` without TOKEN) is named as the user wrote it."""
    if value is not None:
        return value
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, str) else None


def _check_known_keys(node: Any, schema: type, prefix: str = "") -> None:
    """Keys added with ``+group.key=...`` pass Hydra's struct mode; refuse them here."""
    known = {f.name for f in fields(schema)}
    for key in node:
        full = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(
                full,
                OmegaConf.select(node, str(key), throw_on_missing=False),
                f"unknown key: {schema.__name__} has {sorted(known)}",
            )
        child = node[key] if not OmegaConf.is_missing(node, key) else None
        sub = _field_types(schema)[str(key)]
        if isinstance(child, DictConfig) and isinstance(sub, type) and is_dataclass(sub):
            _check_known_keys(child, sub, f"{full}.")


@functools.cache
def _field_types(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists/strings (JSON-safe): what workers, checkpoints and
    summary.json carry. A choice is written as its word."""
    if is_dataclass(obj) and not isinstance(obj, type):
        renamed = RENAMED_FAILURE_KEYS if isinstance(obj, FailureConfig) else {}
        return {
            f.name: to_plain(getattr(obj, f.name)) for f in fields(obj) if f.name not in renamed
        }
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def plain_mapping(node: object) -> dict[str, Any]:
    """An OmegaConf mapping (a group's node, a sweeper's ``params``) as a plain dict of str
    keys, interpolations unresolved; ``{}`` for anything else (None, a list, a value)."""
    plain = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None
    return {str(k): v for k, v in plain.items()} if isinstance(plain, dict) else {}


def register_schema() -> None:
    """Register the schema so conf/config.yaml can extend it (defaults: - ftjob_schema)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="ftjob_schema", node=JobConfig)
