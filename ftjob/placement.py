"""ftjob's own Ray actors and tasks pinned to one node.

The run's ledger and the chaos killer live on the driver's node, a node's snapshot holder on
that node, and a kill or a node reaper on its target's: placed anywhere else they could die with
a worker node, or hit the wrong one. So they are pinned (``soft=False``: never scheduled elsewhere, even when
their node is busy or gone), take no CPU (the node's CPUs are the training's), and are never
restarted or retried (a restarted ledger or holder would have lost its state; a retried kill
would kill twice).

And which machine a process runs on (:func:`machine`): what only processes of one kernel and pid
namespace may do -- map each other's memory, know each other's pids -- is asked of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from ftjob.actors import Actor

T = TypeVar("T")


def pinned_to(node_id: str) -> Any:
    """The scheduling strategy that places a task or actor on ``node_id`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def start_pinned_actor(
    cls: type[T], *args: Any, node_id: str | None = None, **options: Any
) -> Actor[T]:
    """``cls(*args)`` as a zero-CPU Ray actor pinned to ``node_id`` (default: this process's
    node), never restarted; ``options``: more of Ray's actor options (``max_concurrency``...).
    Its handle, whose calls :mod:`ftjob.actors` checks against ``cls``."""
    import ray

    node = node_id or ray.get_runtime_context().get_node_id()
    # Ray's types give the handle as a union with the class itself (for its own decorators)
    actor: Any = ray.remote(num_cpus=0, max_restarts=0, **options)(cls)
    return actor.options(scheduling_strategy=pinned_to(node)).remote(*args)


def run_on_node(
    node_id: str, fn: Callable[..., Any], *args: Any, timeout: float | None = 60.0
) -> Any:
    """``fn(*args)`` as a zero-CPU task pinned to ``node_id``, never retried: its answer, or
    (``timeout=None``) the ObjectRef without waiting -- for a task that takes its own node
    down."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(scheduling_strategy=pinned_to(node_id))
    ref = task.remote(*args)
    return ref if timeout is None else ray.get(ref, timeout=timeout)


def machine() -> str:
    """Which kernel and pid namespace this process runs in: two processes that agree can map
    each other's memory files through ``/proc/<pid>/fd``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


__all__ = ["machine", "pinned_to", "run_on_node", "start_pinned_actor"]
