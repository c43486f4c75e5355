"""Every part of Ray that ftjob uses and Ray does not promise to keep: private modules
(``ray._private``, ``ray._raylet``, ``ray.train.v2._internal``), a generated protobuf, Ray
Train's internal hooks and private names. Checked against Ray 2.60.0: a Ray upgrade is checked
here, in this one file (``tests/test_structure.py`` keeps every other module off them).

What each is used for:

- ``ElasticScalingPolicy``, ``ScalingDecision``, ``NoopDecision``, ``ResizeDecision``,
  ``time_monotonic`` (``ray.train.v2._internal.execution.scaling_policy``,
  ``ray.train.v2._internal.util``): ftjob's elastic policy is a subclass of Ray Train's
  (:mod:`ftjob.driver.scaling`); it also reads and sets the parent's private reservation
  cache and calls its ``_count_possible_workers`` and ``_get_resize_decision``.
- :func:`scaling_policy_factory` (``ray.train.v2.api.data_parallel_trainer
  .create_scaling_policy``): the only hook through which a run chooses its scaling policy.
- ``DatasetsCallback`` (``ray.train.v2._internal.callbacks``): the trainer's dataset
  integration, dropped from its default callbacks (:mod:`ftjob.driver.runner`).
- ``WorkerGroupCallback`` (``ray.train.v2._internal.execution.callback``): the base of the
  callback that tells the drain relay where the workers run (:mod:`ftjob.driver.drains`).
- :func:`draining_nodes` (``ray._private.state``): Ray Core's draining nodes, polled by the
  drain relay.
- :func:`drain_node_for_preemption` (``ray._raylet.GcsClient``, ``ray.core.generated
  .autoscaler_pb2``): chaos's preemption, a drain as a cloud provider's reclaim sends it
  (:mod:`ftjob.chaos.killer`).
- :data:`HEAD_NODE_RESOURCE`: the resource only the head node has (chaos never kills it).
- :func:`preemption_info` (``ray.train.v2._internal.execution.context``): a worker's mark of
  a draining node, read locally -- ``ray.train.get_preemption_info`` is a barrier per call
  (:mod:`ftjob.worker.preemption`).
- :func:`ray_exit_handler`, :func:`set_ray_exit_handler` (``ray._private.worker``): the
  message a worker exits with on SIGTERM, taken over while a preemption notice can still be
  acted on (:mod:`ftjob.worker.preemption`).
- ``get_num_cpus`` (``ray._private.utils``): the CPUs a worker may use, cgroup limits
  included (:mod:`ftjob.worker.context`).
- :data:`STREAMING_EXECUTOR_LOGGER`: Ray Data's executor logger, quietened (one line per
  decoded window would drown the worker logs; :mod:`ftjob.data.streams`).
- :func:`started_ray_processes` (``ray._private.worker.global_worker.node``, a ``Node``'s
  ``all_processes``): the raylet and GCS server of a Ray this process started, watched so the
  driver says at once that Ray died under the run (:mod:`ftjob.driver.ray_death`).

Each name is imported when it is first used, not when this module is: the drain relay and a
worker's preemption reader load only what they read (Ray Train's preemption and dataset types
import Ray Data, 0.6 CPU-seconds).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray._private.utils import get_num_cpus
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
    from ray.train.v2._internal.execution.scaling_policy import (
        NoopDecision,
        ResizeDecision,
        ScalingDecision,
    )
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        TrainAutoscalingCoordinatorClient,
    )
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
    from ray.train.v2._internal.util import time_monotonic

# name -> the module it is imported from, when first asked for (see the module docstring).
_LAZY = {
    "ElasticScalingPolicy": "ray.train.v2._internal.execution.scaling_policy.elastic",
    "TrainAutoscalingCoordinatorClient": (
        "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
    ),
    "ScalingDecision": "ray.train.v2._internal.execution.scaling_policy",
    "NoopDecision": "ray.train.v2._internal.execution.scaling_policy",
    "ResizeDecision": "ray.train.v2._internal.execution.scaling_policy",
    "time_monotonic": "ray.train.v2._internal.util",
    "DatasetsCallback": "ray.train.v2._internal.callbacks",
    "WorkerGroupCallback": "ray.train.v2._internal.execution.callback",
    "get_num_cpus": "ray._private.utils",
}

HEAD_NODE_RESOURCE = "node:__internal_head__"
STREAMING_EXECUTOR_LOGGER = "ray.data._internal.execution.streaming_executor"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # imported once
    return value


@contextlib.contextmanager
def scaling_policy_factory(
    create: Callable[[Any, Callable[[Any], Any]], Any],
) -> Iterator[None]:
    """While active, Ray Train's trainers make their scaling policy with
    ``create(scaling_config, ray_factory)`` (``ray_factory``: Ray Train's own, for the configs
    ``create`` leaves to it); Ray's own again after."""
    from ray.train.v2.api import data_parallel_trainer as dpt

    original = dpt.create_scaling_policy

    def make(scaling_config: Any) -> Any:
        return create(scaling_config, original)

    dpt.create_scaling_policy = make
    try:
        yield
    finally:
        dpt.create_scaling_policy = original


def draining_nodes() -> dict[str, int]:
    """Ray Core's draining nodes: ``{node_id_hex: deadline_ms}`` (0 = no deadline)."""
    import ray._private.state

    return ray._private.state.state.get_draining_nodes() or {}


def drain_node_for_preemption(node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id`` by ``deadline_ms`` with reason preemption (what ``ray
    drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` sends): (accepted, why not)."""
    import ray

    # A compiled module and a generated protobuf: no types to check them against.
    raylet: Any = importlib.import_module("ray._raylet")
    autoscaler_pb2: Any = importlib.import_module("ray.core.generated.autoscaler_pb2")
    client = raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    return client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        message,
        deadline_ms,
    )


def preemption_info() -> Any:
    """The ``PreemptionInfo`` Ray Train marked this worker with (None: not marked), read from
    the worker's own train context without a barrier."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def ray_exit_handler() -> Callable[..., None]:
    """What a Ray worker calls to exit on a signal: ``handler(message, exit_code=1)``."""
    import ray._private.worker as ray_worker

    return ray_worker.raise_sys_exit_with_custom_error_message


def set_ray_exit_handler(handler: Callable[..., None]) -> None:
    import ray._private.worker as ray_worker

    ray_worker.raise_sys_exit_with_custom_error_message = handler


__all__ = [
    "HEAD_NODE_RESOURCE",
    "STREAMING_EXECUTOR_LOGGER",
    "DatasetsCallback",
    "ElasticScalingPolicy",
    "NoopDecision",
    "ResizeDecision",
    "ScalingDecision",
    "TrainAutoscalingCoordinatorClient",
    "WorkerGroupCallback",
    "drain_node_for_preemption",
    "draining_nodes",
    "get_num_cpus",
    "preemption_info",
    "ray_exit_handler",
    "scaling_policy_factory",
    "set_ray_exit_handler",
    "time_monotonic",
]


# What a Node's processes are called in its ``all_processes`` (ray._private.ray_constants).
RAY_PROCESSES = {"raylet": "raylet", "gcs_server": "GCS server"}


def started_ray_processes(node: Any = None) -> dict[str, int]:
    """``{"raylet": pid, "gcs_server": pid}`` of the Ray ``node`` (a ``ray._private.node.Node``;
    by default this process's: the one ``ray.init(address="local")`` started) -- {} for a Ray
    this process only connected to, whose processes it did not start."""
    if node is None:
        import ray._private.worker

        node = getattr(ray._private.worker.global_worker, "node", None)
    processes = getattr(node, "all_processes", None) or {}
    return {
        kind: infos[0].process.pid
        for kind in RAY_PROCESSES
        if (infos := processes.get(kind)) and getattr(infos[0], "process", None) is not None
    }
