"""What a training worker needs from the world around it, in one small object.

In production Ray Train provides it (:func:`ray_context`): rank and world from its train
context, the device, ``ray.train.report`` (a barrier), the process group Ray Train set up, the
run ledger as a Ray actor. In tests a worker runs in this very process against the same code
(:func:`local_context`): world 1, or world 2 as two local processes with a gloo process group;
the ledger is a real :class:`~ftjob.driver.ledger.RunLedger` called directly
(:class:`~ftjob.actors.DirectHandle`), data is decoded in the process instead of by Ray Data tasks, and the
teardown after a just-in-time checkpoint ends the attempt instead of waiting to be killed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.actors import Actor, Fetch, answered
from ftjob.record import WorkerLedger, WorkerPlace
from ftjob.worker.collective import all_gather, broadcast
from ftjob.worker.recorder import RunRecorder


class TornDown(RuntimeError):  # noqa: N818 -- what happened, as Ray Train's restart would say
    """A local attempt ended after a just-in-time checkpoint, as Ray Train would end it."""


def wait_to_be_torn_down() -> None:
    """Production: the node goes (or Ray Train stops the group); returning would tell Ray
    Train that training finished."""
    while True:
        time.sleep(1.0)


@dataclass
class WorkerContext:
    rank: int
    world: int
    device: Any  # torch.device
    recorder: RunRecorder
    where: WorkerPlace  # where chaos and hang handling find this rank
    report: Callable[[dict[str, Any]], None]  # every rank, together: Ray Train's view of progress
    fetch: Fetch  # the value of an object the driver put in the object store
    prepare_model: Callable[[Any], Any]  # the model wrapped for data parallelism (DDP)
    decode_here: bool = False  # decode every window in this process, not in Ray Data tasks
    local_world: int = 1  # training workers on this machine (Ray Train counts by node IP)
    local_rank: int = 0  # this worker's index among them
    machine: Callable[[], tuple[float, bool]] = lambda: (1.0, True)  # cores, one-machine cluster
    drain_notice: Callable[[], tuple[float | None, list[int]] | None] | None = None
    ray_signals: bool = False  # SIGTERM to this process arrives through Ray's handler
    teardown: Callable[[], None] = wait_to_be_torn_down

    def broadcast(self, obj: Any) -> Any:
        """``obj`` from rank 0, on every rank."""
        return broadcast(obj, self.world)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        return all_gather(obj, self.world)


def ray_context(ledger: Actor[WorkerLedger]) -> WorkerContext:
    """The context of a Ray Train worker (called inside the train function)."""
    import ray
    import ray.train
    import ray.train.torch

    from ftjob.worker.preemption import ray_drain_notice

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    return WorkerContext(
        rank=rank,
        world=ctx.get_world_size(),
        local_world=ctx.get_local_world_size(),
        local_rank=ctx.get_local_rank(),
        machine=_ray_machine,
        device=ray.train.torch.get_device(),
        recorder=RunRecorder(ledger, rank, ray.get),
        where=WorkerPlace(
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            raylet_pid=os.getppid(),  # a Ray worker's parent is its node's raylet
        ),
        report=ray.train.report,
        fetch=ray.get,
        prepare_model=ray.train.torch.prepare_model,
        drain_notice=ray_drain_notice,
        ray_signals=True,
    )


def _ray_machine() -> tuple[float, bool]:
    """The CPUs this process may use (Ray's count: cgroup limits included), and whether every
    live node of the cluster is on this machine (a simulated cluster, or one node)."""
    import ray

    from ftjob.ray_internals import get_num_cpus

    here = ray.util.get_node_ip_address()
    ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return float(get_num_cpus()), ips <= {here}


def local_context(
    ledger: Actor[WorkerLedger], rank: int = 0, world: int = 1, node_per_rank: bool = False
) -> WorkerContext:
    """A worker in this process: world 1, or one of ``world`` processes that joined a gloo
    process group already (see tests/support/local_run.py). ``ledger`` answers at once (a
    :class:`DirectHandle`, or a proxy of a ledger in another process). ``node_per_rank``: each
    rank stands for a node of its own (``node<rank>``), as on a cluster of one rank a node."""
    import torch

    def prepare(model: Any) -> Any:
        if world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    def report(metrics: dict[str, Any]) -> None:
        if world > 1:  # ray.train.report is a barrier across the workers
            torch.distributed.barrier()

    def end_attempt() -> None:
        raise TornDown("torn down after the just-in-time checkpoint")

    return WorkerContext(
        rank=rank,
        world=world,
        device=torch.device("cpu"),
        recorder=RunRecorder(ledger, rank, answered),
        where=WorkerPlace(
            node_id=f"node{rank}" if node_per_rank else "local",
            pid=os.getpid(),
            raylet_pid=os.getppid(),
        ),
        local_rank=0 if node_per_rank else rank,
        report=report,
        fetch=answered,
        prepare_model=prepare,
        decode_here=True,
        teardown=end_attempt,
    )
