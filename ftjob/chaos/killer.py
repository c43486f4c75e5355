"""Chaos on a Ray cluster: kills as zero-CPU tasks pinned to their node, node drains through
GCS, the killer actor on the driver's node that runs a :class:`~ftjob.chaos.schedule.ChaosKiller`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Protocol

from ftjob.actors import Actor, ask, tell
from ftjob.chaos import reap
from ftjob.chaos.reap import take_node_down
from ftjob.chaos.schedule import ChaosKiller, KillSchedule
from ftjob.config import NODE_KINDS, WORKER_KINDS, ChaosConfig
from ftjob.placement import run_on_node, start_pinned_actor
from ftjob.ray_internals import HEAD_NODE_RESOURCE, drain_node_for_preemption
from ftjob.record import ChaosSkip, ChaosView, Kill, KillTarget


def _kill_on_node(kind: str, pid: int | None) -> int:
    """Runs on the target node. A Ray worker's parent process is its node's raylet; a hang is
    a training worker stopped with SIGSTOP, which nothing here resumes."""
    if kind not in WORKER_KINDS:
        take_node_down(os.getppid())  # this task is one of the node's: it ends here
        return -1
    victim = int(pid or 0)
    os.kill(victim, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
    return victim


def _ray_kill(kind: str, target: KillTarget, notice: float = 0.0) -> int:
    """A kill as a zero-CPU task pinned to the target node; ``preempt`` as :func:`_preempt`."""
    if kind == "slow":
        return -1  # no signal: the ledger tells the rank through its heartbeat
    if kind == "preempt":
        return _preempt(target.node_id, notice)
    if kind in NODE_KINDS:  # the task dies with its raylet; its answer never comes
        run_on_node(target.node_id, _kill_on_node, kind, None, timeout=None)
        return -1
    return int(run_on_node(target.node_id, _kill_on_node, kind, target.pid, timeout=30))


class NodeReaper:
    """An actor on the node to preempt: armed, it starts the process that kills its node (its
    raylet and all under it) at the deadline. Armed before the drain, since a draining node
    takes no new work. That process is a session of its own: the node goes at its deadline
    whatever happens to the driver that preempted it, as a cloud's reclaim does -- a thread of
    the actor died with a driver killed inside the notice, and left the node draining for
    good (it took no work again: a run sized to the cluster waited for it forever)."""

    def arm(self, delay: float) -> int:
        """Start the reaper (``ftjob/chaos/reap.py``, the standard library only: it starts in
        a moment, and its errors go to this actor's log); the raylet's pid."""
        raylet = os.getppid()
        subprocess.Popen(
            [sys.executable, "-I", "-S", reap.__file__, repr(time.time() + delay), str(raylet)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        return raylet


_reapers: list[Actor[NodeReaper]] = []  # armed reapers: an actor whose handle is dropped is killed


def _preempt(node_id: str, notice: float) -> int:
    """Drain the node through Ray's drain API with ``notice`` seconds to its deadline (reason:
    preemption), as a cloud provider's reclaim would, and kill it at the deadline."""
    reaper = start_pinned_actor(NodeReaper, node_id=node_id)
    raylet = ask(reaper, NodeReaper.arm, 60, notice)
    _reapers.append(reaper)
    drain_node(node_id, notice)
    return raylet


def drain_node(node_id: str, notice: float) -> None:
    """Tell Ray the node goes away in ``notice`` seconds (what ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION`` sends); ftjob's drain relay sees it."""
    accepted, why = drain_node_for_preemption(
        node_id,
        f"ftjob chaos: preempted with {notice:g} s of notice",
        int((time.time() + notice) * 1000),
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id[:12]}: {why}")


def _node_gone(target: KillTarget, timeout: float = 60.0) -> bool:
    """Is the killed node gone? Its raylet no longer answers the GCS (Ray marks the node dead)
    or, before that, its workers are gone (the kill task died with its raylet)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if target.node_id not in alive:
            return True
        time.sleep(0.5)
    return False


class KillerLedger(Protocol):
    """The run ledger's methods the killer actor calls (the run's
    :class:`~ftjob.driver.ledger.RunLedger` has them)."""

    def chaos_view(self) -> ChaosView: ...
    def kill(self, record: Kill) -> None: ...
    def chaos_skipped(self, record: ChaosSkip) -> None: ...
    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None: ...
    def log(self, line: str) -> None: ...


class _LedgerView:
    """Synchronous view of the ledger actor for the killer (its
    :class:`~ftjob.chaos.schedule.ChaosLedger`)."""

    def __init__(self, handle: Actor[KillerLedger]) -> None:
        self.handle = handle

    def chaos_view(self) -> ChaosView:
        return ask(self.handle, KillerLedger.chaos_view, None)

    def record_kill(self, record: Kill) -> None:
        tell(self.handle, KillerLedger.kill, record)

    def record_skip(self, record: ChaosSkip) -> None:
        tell(self.handle, KillerLedger.chaos_skipped, record)

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        tell(self.handle, KillerLedger.confirm_kill, time_of_kill, confirmed)

    def report_error(self, message: str) -> None:
        tell(self.handle, KillerLedger.log, message)


class KillerActor:
    """Ray actor wrapper: runs a ChaosKiller on a thread until the schedule ends or stop()."""

    def __init__(
        self, chaos: ChaosConfig, ledger: Actor[KillerLedger], protected_nodes: list[str]
    ) -> None:
        notice = chaos.notice
        self.killer = ChaosKiller(
            KillSchedule.from_config(chaos),
            [k.value for k in chaos.kinds()],
            _LedgerView(ledger),
            set(protected_nodes),
            at_steps=list(chaos.at_steps),
            notice=notice,
            slowdown=chaos.slowdown,
            target=chaos.target,
            execute=lambda kind, target: _ray_kill(kind, target, notice),
            confirm=lambda target: _node_gone(target, 60.0 + notice),
        )
        self.thread = threading.Thread(target=self.killer.run, name="ftjob-chaos", daemon=True)
        self.thread.start()

    def stop(self) -> list[Kill]:
        self.killer.stop()
        self.thread.join(timeout=10)
        return self.killer.kills


def protected_nodes() -> list[str]:
    """The head node and the driver's node: never chaos targets."""
    import ray

    head = [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and HEAD_NODE_RESOURCE in n.get("Resources", {})
    ]
    return sorted(set(head) | {ray.get_runtime_context().get_node_id()})


def node_chaos_targets() -> list[str]:
    """Alive nodes with CPUs that node chaos may kill (not the head, not the driver's)."""
    import ray

    protected = set(protected_nodes())
    return [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and n["NodeID"] not in protected and n["Resources"].get("CPU", 0) > 0
    ]


def start_killer(chaos: ChaosConfig, ledger: Actor[KillerLedger]) -> Actor[KillerActor]:
    """Start the killer actor on the driver's node (the head node of a local cluster)."""
    return start_pinned_actor(KillerActor, chaos, ledger, protected_nodes(), max_concurrency=2)
