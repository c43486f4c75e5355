"""Chaos: the kill schedule and the killer's decisions (pure: clock, wait and the kill itself
are injected; the Ray side is :mod:`ftjob.chaos.killer`).

The schedule's clock starts at the run's first training step. Kill ``k`` lands at a random
point of its window ``[start_delay + k*interval, start_delay + (k+1)*interval)`` (as Ray's
release-test chaos does), or at the window's end with ``chaos.jitter=false``; the same seed
gives the same times. A kill waits, if needed, until the current attempt is training, so each
kill causes one real failure rather than hitting workers that are already gone.

Targets are only nodes or processes that host training workers: a node kill never hits the head
node or the driver's node; a worker kill hits a training worker process wherever it runs. A node
kill SIGKILLs the node's raylet and every process under it (its Ray workers), as a node that
dies takes them all; a worker kill SIGKILLs one training worker process; a hang SIGSTOPs one (nothing
resumes it: hang detection must find it). Each runs as a zero-CPU task pinned to the target
node, so they work on real multi-node clusters too. ``slow`` sends no signal: the chosen rank
learns through its heartbeat that it must sleep a fraction of each step from then on.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from ftjob.config import ENDS_ATTEMPT, NODE_KINDS, WORKER_KINDS, ChaosConfig
from ftjob.record import ChaosSkip, ChaosView, Kill, KillTarget, WorkerPlace

logger = logging.getLogger("ftjob.chaos.schedule")
T = TypeVar("T")


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
    kind: str, workers: tuple[WorkerPlace, ...] | list[WorkerPlace], protected_nodes: set[str]
) -> list[WorkerPlace]:
    """Training workers that may be hit. A node kill never takes down a protected (head or
    driver) node; a worker kill only ever hits a training worker process, wherever it runs."""
    if kind in WORKER_KINDS:
        return list(workers)
    return [w for w in workers if w.node_id not in protected_nodes]  # node, preempt


def choose_target(
    kind: str, workers: list[WorkerPlace], rng: random.Random, target: str = "any"
) -> KillTarget:
    """A node (all its training workers die) or one training worker process: at random, or
    (``target="rank0"``) rank 0's when it may be hit."""
    chosen = [w for w in workers if w.rank == 0] if target == "rank0" else []
    if kind in NODE_KINDS:
        nodes = sorted({w.node_id for w in chosen or workers})
        node = rng.choice(nodes)
        ranks = tuple(w.rank for w in workers if w.node_id == node and w.rank is not None)
        return KillTarget(node_id=node, ranks=ranks)
    worker = rng.choice(sorted(chosen or workers, key=lambda w: w.rank or 0))
    return KillTarget(node_id=worker.node_id, pid=worker.pid, rank=worker.rank)


def describe_chaos(record: Kill, count: int) -> str:
    """The progress line of a chaos event (``count``: kills so far, this one included)."""
    target, kind = record.target, record.kind
    ranks = list(target.ranks) if target.ranks is not None else None
    node = f"node {target.node_id[:12]} (ranks {ranks})"
    worker = f"worker rank {target.rank} (pid {target.pid})"
    if kind == "preempt":
        notice = (record.deadline or 0.0) - (record.notice or 0.0)
        return f"chaos: preempting {node}: drained with {notice:.0f} s of notice"
    if kind == "node":
        return f"chaos: killing {node}"
    if kind == "hang":
        return f"chaos: hang {count}: {worker} stopped with SIGSTOP; nothing here resumes it"
    if kind == "slow":
        return f"chaos: slow {count}: {worker} now sleeps {record.slowdown or 0.0:.0%} of each step"
    return f"chaos: kill {count}: {worker}"


class ChaosLedger(Protocol):
    """What the killer asks of the run ledger, and tells it."""

    def chaos_view(self) -> ChaosView: ...
    def record_kill(self, record: Kill) -> None: ...
    def record_skip(self, record: ChaosSkip) -> None: ...
    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None: ...
    def report_error(self, message: str) -> None: ...


class ChaosKiller:
    """Carries out a :class:`KillSchedule` (or ``at_steps``) against the run's training workers.

    ``kinds``: what each kill does, in turn (kill ``k`` is ``kinds[k % len(kinds)]``: one kind,
    or ``chaos.mix``). ``ledger`` is the run ledger (training workers, attempts, kill records); ``execute`` does a
    kill, ``confirm`` tells whether a killed node is gone, and ``clock``/``wait`` are
    injectable so the logic is tested without Ray or sleeping. Every window ends in a kill or
    a skip record with its reason: chaos that did not happen is never silent.
    """

    def __init__(
        self,
        schedule: KillSchedule,
        kinds: list[str],
        ledger: ChaosLedger,
        protected_nodes: set[str],
        *,
        at_steps: list[int] | None = None,
        notice: float = 30.0,
        slowdown: float = 0.5,
        target: str = "any",
        execute: Callable[[str, KillTarget], int],
        confirm: Callable[[KillTarget], bool] = lambda target: True,
        clock: Callable[[], float] = time.time,
        wait: Callable[[float], bool] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.schedule, self.kinds, self.ledger = schedule, list(kinds), ledger
        self.at_steps = sorted(at_steps or [])
        self.notice, self.slowdown = notice, slowdown
        self.target = target  # chaos.target
        self.protected = set(protected_nodes)
        self.execute, self.confirm = execute, confirm
        self.clock = clock
        self._stop = threading.Event()
        self.wait = wait or self._stop.wait
        self.poll_s = poll_s
        self.rng = random.Random(schedule.seed + 1)
        self.kills: list[Kill] = []
        self.skipped: list[ChaosSkip] = []
        self.confirming: list[threading.Thread] = []
        self.last_attempt = -1

    def stop(self) -> None:
        self._stop.set()

    def kind(self, index: int) -> str:
        """What kill ``index`` does."""
        return self.kinds[index % len(self.kinds)]

    def _view(self) -> ChaosView:
        return self.ledger.chaos_view()

    def run(self) -> list[Kill]:
        try:
            self._run()
        except Exception as exc:  # a broken killer must be seen, not silently stop the chaos
            logger.exception("chaos killer stopped")
            self.ledger.report_error(f"chaos killer stopped: {type(exc).__name__}: {exc}")
        for confirming in self.confirming:  # node kills still waiting for Ray's word
            while confirming.is_alive() and not self._stop.is_set():
                confirming.join(timeout=0.5)
        return sorted(self.kills, key=lambda k: k.time)

    def _wait_until(self, ready: Callable[[ChaosView], T | None]) -> T | None:
        """Poll the ledger until ``ready(view)`` is not None; None if told to stop."""
        while (result := ready(self._view())) is None:
            if self.wait(self.poll_s):
                return None
        return result

    def _due(self, view: ChaosView, index: int, start: float) -> bool:
        if self.at_steps:
            return view.step >= self.at_steps[index]
        return self.clock() >= start + self.schedule.times()[index]

    def _run(self) -> None:
        start = self._wait_until(lambda v: v.training_started)
        if start is None:  # told to stop first
            return
        count = len(self.at_steps) if self.at_steps else self.schedule.max_kills
        for index in range(self._passed_steps(), count):
            view = self._wait_until(functools.partial(self._ready, index=index, start=start))
            if view is None:
                return
            self._strike(index, view)

    def _ready(self, view: ChaosView, index: int, start: float) -> ChaosView | None:
        """``view`` once kill ``index`` is due and an attempt the previous kill did not
        already hit is training."""
        fresh = view.training and (view.attempt or 0) > self.last_attempt
        return view if fresh and self._due(view, index, start) else None

    def _passed_steps(self) -> int:
        """``at_steps`` a continued run (``resume``) had trained past when this driver started
        it: their kills were its earlier driver's, each recorded as skipped with that reason.
        The same command, run again after a driver's death, keeps its schedule by step."""
        view = self._view()
        passed = [s for s in self.at_steps if s <= view.started_at]
        for index, step in enumerate(passed):
            self._skip(
                index,
                view,
                f"the run had trained past step {step} (it continued from step "
                f"{view.started_at}): that kill was its earlier driver's",
            )
        return len(passed)

    def _skip(self, index: int, view: ChaosView, reason: str) -> None:
        record = ChaosSkip(self.clock(), self.kind(index), reason, view.attempt, window=index + 1)
        self.skipped.append(record)
        self.ledger.record_skip(record)

    def _strike(self, index: int, view: ChaosView) -> None:
        attempt, kind = view.attempt, self.kind(index)
        targets = eligible_targets(kind, view.workers, self.protected)
        if not targets:
            self._skip(
                index,
                view,
                "no eligible target: every training worker runs on the head "
                "or the driver's node, which node chaos never kills (trainer.placement=SPREAD "
                "or more nodes give it one)",
            )
            return
        target = choose_target(kind, targets, self.rng, self.target)
        now = self.clock()
        record = Kill(time=now, kind=kind, target=target, attempt=attempt)
        if kind == "preempt":  # the drain is the notice; the node goes at the deadline
            record = replace(record, notice=now, deadline=now + self.notice)
        if kind == "slow":
            record = replace(record, slowdown=self.slowdown)
        try:
            record = replace(record, killed_pid=self.execute(kind, target))
        except Exception as exc:  # a target that vanished on its own is not a kill
            logger.warning("chaos: %s kill of %s failed: %s", kind, target, exc)
            self._skip(index, view, f"the kill of {target} failed: {type(exc).__name__}: {exc}")
            return
        if kind in ENDS_ATTEMPT and attempt is not None:
            self.last_attempt = attempt
        self.ledger.record_kill(record)  # now: a simulated cluster replaces the node from it
        if kind not in NODE_KINDS:
            self.kills.append(record)
            return
        # Ray takes a while to declare a node dead: confirm on the side, not blocking the
        # next window.
        confirming = threading.Thread(
            target=self._confirm, args=(record,), name="ftjob-chaos-confirm", daemon=True
        )
        confirming.start()
        self.confirming.append(confirming)

    def _confirm(self, record: Kill) -> None:
        confirmed = self.confirm(record.target)
        self.ledger.confirm_kill(record.time, confirmed)
        if confirmed:
            self.kills.append(record)
        else:
            self.skipped.append(ChaosSkip.of_kill(record, "the node was not confirmed dead"))
