"""Chaos: a kill schedule, the killer actor that carries it out, and the local multi-node
cluster that lets node kills run on one machine.

The schedule's clock starts at the run's first training step. Kill ``k`` lands at a random
point of its window ``[start_delay + k*interval, start_delay + (k+1)*interval)`` (as Ray's
release-test chaos does), or at the window's end with ``chaos.jitter=false``; the same seed
gives the same times. A kill waits, if needed, until the current attempt is training, so each
kill causes one real failure rather than hitting workers that are already gone.

Targets are only nodes or processes that host training workers: a node kill never hits the head
node or the driver's node; a worker kill hits a training worker process wherever it runs. A node
kill SIGKILLs the node's raylet (the parent of every Ray worker on it), which takes the whole
node down; a worker kill SIGKILLs one training worker process; a hang SIGSTOPs one (nothing
resumes it: hang detection must find it). Each runs as a zero-CPU task pinned to the target
node, so they work on real multi-node clusters too. ``slow`` sends no signal: the chosen rank
learns through its heartbeat that it must sleep a fraction of each step from then on.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.config import ChaosConfig

logger = logging.getLogger("ftjob.chaos")

NODE_KINDS = ("node", "preempt")  # chaos that takes a whole node away
WORKER_KINDS = ("worker", "hang", "slow")  # chaos that hits one training worker
ENDS_ATTEMPT = ("node", "preempt", "worker", "hang")  # the next window waits for a restart


@dataclass(frozen=True)
class KillSchedule:
    interval: float
    max_kills: int
    start_delay: float = 0.0
    jitter: bool = True
    seed: int = 0

    @classmethod
    def from_config(cls, chaos: ChaosConfig) -> KillSchedule:
        return cls(chaos.interval, chaos.max_kills, chaos.start_delay, chaos.jitter, chaos.seed)

    def times(self) -> list[float]:
        """Seconds after the first training step at which each kill is due."""
        rng = random.Random(self.seed)
        out = []
        for k in range(self.max_kills):
            window = self.start_delay + k * self.interval
            out.append(window + (rng.uniform(0, self.interval) if self.jitter else self.interval))
        return out


def eligible_targets(
    kind: str, workers: list[dict[str, Any]], protected_nodes: set[str]
) -> list[dict[str, Any]]:
    """Training workers that may be hit. A node kill never takes down a protected (head or
    driver) node; a worker kill only ever hits a training worker process, wherever it runs."""
    if kind in WORKER_KINDS:
        return list(workers)
    return [w for w in workers if w.get("node_id") not in protected_nodes]  # node, preempt


def choose_target(kind: str, workers: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    """A node (all its training workers die) or one training worker process."""
    if kind in NODE_KINDS:
        nodes = sorted({w["node_id"] for w in workers})
        node = rng.choice(nodes)
        ranks = [w["rank"] for w in workers if w["node_id"] == node]
        return {"node_id": node, "ranks": ranks}
    worker = rng.choice(sorted(workers, key=lambda w: w["rank"]))
    return {"node_id": worker["node_id"], "pid": worker["pid"], "rank": worker["rank"]}


def _kill_on_node(kind: str, pid: int | None) -> int:
    """Runs on the target node. A Ray worker's parent process is its node's raylet; a hang is
    a training worker stopped with SIGSTOP, which nothing here resumes."""
    victim = int(pid or 0) if kind in WORKER_KINDS else os.getppid()
    os.kill(victim, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
    return victim


def describe_chaos(record: dict[str, Any], count: int) -> str:
    """The progress line of a chaos event (``count``: kills so far, this one included)."""
    target, kind = record.get("target", {}), record["kind"]
    node = f"node {target.get('node_id', '?')[:12]} (ranks {target.get('ranks')})"
    worker = f"worker rank {target.get('rank')} (pid {target.get('pid')})"
    if kind == "preempt":
        notice = record["deadline"] - record["notice"]
        return f"chaos: preempting {node}: drained with {notice:.0f} s of notice"
    if kind == "node":
        return f"chaos: killing {node}"
    if kind == "hang":
        return f"chaos: hang {count}: {worker} stopped with SIGSTOP; nothing here resumes it"
    if kind == "slow":
        return f"chaos: slow {count}: {worker} now sleeps {record['slowdown']:.0%} of each step"
    return f"chaos: kill {count}: {worker}"


class ChaosKiller:
    """Carries out a :class:`KillSchedule` (or ``at_steps``) against the run's training workers.

    ``ledger`` is the run ledger (training workers, attempts, kill records); ``execute`` does a
    kill, ``confirm`` tells whether a killed node is gone, and ``clock``/``wait`` are
    injectable so the logic is tested without Ray or sleeping. Every window ends in a kill or
    a skip record with its reason: chaos that did not happen is never silent.
    """

    def __init__(
        self,
        schedule: KillSchedule,
        kind: str,
        ledger: Any,
        protected_nodes: set[str],
        *,
        at_steps: list[int] | None = None,
        notice: float = 30.0,
        slowdown: float = 0.5,
        execute: Callable[[str, dict[str, Any]], int] | None = None,
        confirm: Callable[[dict[str, Any]], bool] | None = None,
        clock: Callable[[], float] = time.time,
        wait: Callable[[float], bool] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.schedule, self.kind, self.ledger = schedule, kind, ledger
        self.at_steps = sorted(at_steps or [])
        self.notice, self.slowdown = notice, slowdown
        self.protected = set(protected_nodes)
        self.execute = execute or (lambda kind, target: _ray_kill(kind, target, notice))
        self.confirm = confirm or (lambda target: _node_gone(target, 60.0 + notice))
        self.clock = clock
        self._stop = threading.Event()
        self.wait = wait or self._stop.wait
        self.poll_s = poll_s
        self.rng = random.Random(schedule.seed + 1)
        self.kills: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.confirming: list[threading.Thread] = []
        self.last_attempt = -1

    def stop(self) -> None:
        self._stop.set()

    def _view(self) -> dict[str, Any]:
        return self.ledger.chaos_view()

    def run(self) -> list[dict[str, Any]]:
        try:
            self._run()
        except Exception as exc:  # a broken killer must be seen, not silently stop the chaos
            logger.exception("chaos killer stopped")
            self.ledger.report_error(f"chaos killer stopped: {type(exc).__name__}: {exc}")
        for confirming in self.confirming:  # node kills still waiting for Ray's word
            while confirming.is_alive() and not self._stop.is_set():
                confirming.join(timeout=0.5)
        return sorted(self.kills, key=lambda k: k["time"])

    def _wait_until(self, ready: Callable[[dict[str, Any]], Any]) -> Any:
        """Poll the ledger until ``ready(view)`` is not None; None if told to stop."""
        while (result := ready(self._view())) is None:
            if self.wait(self.poll_s):
                return None
        return result

    def _due(self, view: dict[str, Any], index: int, start: float) -> bool:
        if self.at_steps:
            return view["step"] >= self.at_steps[index]
        return self.clock() >= start + self.schedule.times()[index]

    def _run(self) -> None:
        start = self._wait_until(lambda v: v["training_started"])
        count = len(self.at_steps) if self.at_steps else self.schedule.max_kills
        for index in range(count if start is not None else 0):
            # Due, and an attempt the previous kill did not already hit is training.
            view = self._wait_until(
                lambda v, i=index: (
                    v
                    if v["training"] and v["attempt"] > self.last_attempt and self._due(v, i, start)
                    else None
                )
            )
            if view is None:
                return
            self._strike(index, view)

    def _skip(self, index: int, view: dict[str, Any], reason: str) -> None:
        record = {"time": self.clock(), "kind": self.kind, "window": index + 1, "reason": reason}
        record["attempt"] = view["attempt"]
        self.skipped.append(record)
        self.ledger.record_skip(record)

    def _strike(self, index: int, view: dict[str, Any]) -> None:
        attempt = view["attempt"]
        targets = eligible_targets(self.kind, view["workers"], self.protected)
        if not targets:
            self._skip(
                index,
                view,
                "no eligible target: every training worker runs on the head "
                "or the driver's node, which node chaos never kills (trainer.placement=SPREAD "
                "or more nodes give it one)",
            )
            return
        target = choose_target(self.kind, targets, self.rng)
        record = {"time": self.clock(), "kind": self.kind, "target": target, "attempt": attempt}
        if self.kind == "preempt":  # the drain is the notice; the node goes at the deadline
            record.update(notice=record["time"], deadline=record["time"] + self.notice)
        if self.kind == "slow":
            record["slowdown"] = self.slowdown
        try:
            record["killed_pid"] = self.execute(self.kind, target)
        except Exception as exc:  # a target that vanished on its own is not a kill
            logger.warning("chaos: %s kill of %s failed: %s", self.kind, target, exc)
            self._skip(index, view, f"the kill of {target} failed: {type(exc).__name__}: {exc}")
            return
        if self.kind in ENDS_ATTEMPT:
            self.last_attempt = attempt
        self.ledger.record_kill(record)  # now: a simulated cluster replaces the node from it
        if self.kind not in NODE_KINDS:
            self.kills.append(record)
            return
        # Ray takes a while to declare a node dead: confirm on the side, not blocking the
        # next window.
        confirming = threading.Thread(
            target=self._confirm, args=(record,), name="ftjob-chaos-confirm", daemon=True
        )
        confirming.start()
        self.confirming.append(confirming)

    def _confirm(self, record: dict[str, Any]) -> None:
        confirmed = self.confirm(record["target"])
        self.ledger.confirm_kill(record["time"], confirmed)
        if confirmed:
            self.kills.append(record)
        else:
            self.skipped.append({**record, "reason": "the node was not confirmed dead"})


def _ray_kill(kind: str, target: dict[str, Any], notice: float = 0.0) -> int:
    """A kill as a zero-CPU task pinned to the target node; ``preempt`` as :func:`_preempt`."""
    from ftjob.cluster import run_on_node

    if kind == "slow":
        return -1  # no signal: the ledger tells the rank through its heartbeat
    if kind == "preempt":
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node_id=target["node_id"], soft=False)
        return _preempt(target["node_id"], notice, strategy)
    if kind in NODE_KINDS:  # the task dies with its raylet; its answer never comes
        run_on_node(target["node_id"], _kill_on_node, kind, None, timeout=None)
        return -1
    return int(run_on_node(target["node_id"], _kill_on_node, kind, target.get("pid"), timeout=30))


class NodeReaper:
    """An actor on the node to preempt: armed, it kills its node (its raylet) at the deadline.
    Armed before the drain, since a draining node takes no new work."""

    def arm(self, delay: float) -> int:
        raylet = os.getppid()

        def fire() -> None:
            time.sleep(delay)
            os.kill(raylet, signal.SIGKILL)

        threading.Thread(target=fire, name="ftjob-reaper", daemon=True).start()
        return raylet


_reapers: list[Any] = []  # armed reapers: an actor whose handle is dropped is killed


def _preempt(node_id: str, notice: float, strategy: Any) -> int:
    """Drain the node through Ray's drain API with ``notice`` seconds to its deadline (reason:
    preemption), as a cloud provider's reclaim would, and kill it at the deadline."""
    import ray

    reaper = (
        ray.remote(num_cpus=0, max_restarts=0)(NodeReaper)
        .options(scheduling_strategy=strategy)
        .remote()
    )
    raylet = int(ray.get(reaper.arm.remote(notice), timeout=60))
    _reapers.append(reaper)
    drain_node(node_id, notice)
    return raylet


def drain_node(node_id: str, notice: float) -> None:
    """Tell Ray the node goes away in ``notice`` seconds (what ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION`` sends); ftjob's drain relay sees it."""
    import ray
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + notice) * 1000)
    accepted, why = client.drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        f"ftjob chaos: preempted with {notice:g} s of notice",
        deadline_ms,
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id[:12]}: {why}")


def _node_gone(target: dict[str, Any], timeout: float = 60.0) -> bool:
    """Is the killed node gone? Its raylet no longer answers the GCS (Ray marks the node dead)
    or, before that, its workers are gone (the kill task died with its raylet)."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if target["node_id"] not in alive:
            return True
        time.sleep(0.5)
    return False


class _LedgerView:
    """Synchronous view of the ledger actor for the killer."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def chaos_view(self) -> dict[str, Any]:
        import ray

        return ray.get(self.handle.chaos_view.remote())

    def record_kill(self, record: dict[str, Any]) -> None:
        self.handle.kill.remote(record)

    def record_skip(self, record: dict[str, Any]) -> None:
        self.handle.chaos_skipped.remote(record)

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        self.handle.confirm_kill.remote(time_of_kill, confirmed)

    def report_error(self, message: str) -> None:
        self.handle.log.remote(message)


class KillerActor:
    """Ray actor wrapper: runs a ChaosKiller on a thread until the schedule ends or stop()."""

    def __init__(self, chaos: ChaosConfig, ledger: Any, protected_nodes: list[str]) -> None:
        self.killer = ChaosKiller(
            KillSchedule.from_config(chaos),
            chaos.kind,
            _LedgerView(ledger),
            set(protected_nodes),
            at_steps=list(chaos.at_steps),
            notice=chaos.notice,
            slowdown=chaos.slowdown,
        )
        self.thread = threading.Thread(target=self.killer.run, name="ftjob-chaos", daemon=True)
        self.thread.start()

    def stop(self) -> list[dict[str, Any]]:
        self.killer.stop()
        self.thread.join(timeout=10)
        return self.killer.kills


def protected_nodes() -> list[str]:
    """The head node and the driver's node: never chaos targets."""
    import ray

    head = [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})
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


def start_killer(chaos: ChaosConfig, ledger: Any) -> Any:
    """Start the killer actor on the driver's node (the head node of a local cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(KillerActor)
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    return actor.options(scheduling_strategy=strategy).remote(chaos, ledger, protected_nodes())
