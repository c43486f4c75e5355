"""``_target_`` nodes (``model``, ``dataset``, ``optimizer``, and a user's own): the class or
function each names is imported, and the node's keys bound to its signature, before Ray starts
-- so a typo in a module path or an argument name is refused in a second, not in a worker.

Checking a target imports its module, and runs whatever that module does on import: this
happens only when :func:`check_job_targets` (called once, by
:func:`ftjob.config.load.load_job`) or ``python -m ftjob.check`` asks for it, never when a
config dataclass is built.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ftjob.config.job import JobConfig
from ftjob.config.rules import ConfigError, is_placeholder

# Keys Hydra's instantiate reads itself.
_HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")

# The `_target_` groups of the job, and the arguments ftjob passes to each itself (the node
# must not set them; the target must accept them).
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("num_classes",),
    "dataset": (),
    "optimizer": ("params", "lr"),
}


def check_job_targets(job: JobConfig) -> None:
    """Import the target of each of the job's ``_target_`` groups and check the node against
    it (:func:`check_target`). Imports the targets' modules."""
    for group in TARGET_GROUPS:
        check_group_target(getattr(job, group), group)


def check_group_target(node: dict[str, Any], group: str) -> Callable[..., Any]:
    """:func:`check_target` for one of :data:`TARGET_GROUPS`. Imports the target's module."""
    passed = TARGET_GROUPS[group]
    return check_target(node, group, skip=passed, needs=passed)


def check_target(
    node: dict[str, Any], group: str, skip: tuple[str, ...] = (), needs: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """Import ``node['_target_']`` (its module runs on import) and bind the node's other keys
    to its signature; ``needs`` are arguments ftjob passes itself, which the target must
    accept. A target with a ``check_args`` callable has it called with the bound arguments
    (the dataset's value rules). Returns the target."""
    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(
            f"{group}._target_", target, "must name the class or function that builds the " + group
        )
    obj = import_target(target, f"{group}._target_")
    kwargs = {k: v for k, v in node.items() if k not in _HYDRA_KEYS and k not in skip}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return obj
    params = [p for p in signature.parameters if p not in skip and p != "self"]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    refused = [n for n in needs if n not in signature.parameters and not takes_any]
    if refused:
        raise ConfigError(
            f"{group}._target_",
            target,
            f"takes no {refused[0]!r} argument, which ftjob passes to every {group} "
            f"(it takes {params})",
        )
    unknown = [k for k in kwargs if k not in signature.parameters]
    if unknown and not takes_any:
        raise ConfigError(
            f"{group}.{unknown[0]}",
            kwargs[unknown[0]],
            f"{target} takes no such argument; it takes {params}",
        )
    try:
        bound = signature.bind_partial(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            group, sorted(kwargs), f"{target} cannot take these keys ({exc}); it takes {params}"
        ) from None
    check_args = getattr(obj, "check_args", None)
    if callable(check_args) and not any(is_placeholder(v) for v in kwargs.values()):
        arguments = {
            name: p.default
            for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        arguments.update(bound.arguments)
        check_args(**arguments)
    return obj


def import_target(path: str, key: str) -> Any:
    """The object ``path`` (``package.module.Name``) names, importing its module."""
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            key, path, f"cannot be imported ({exc}); is the module installed or on PYTHONPATH?"
        ) from None
