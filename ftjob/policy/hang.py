"""Hangs, stragglers and restart loops, decided outside the workers.

Every rank's heartbeat thread tells the run ledger, about once a second, which section it is in
(setup, restore, warmup, step, validation, checkpoint), how long ago it last made progress, and
how long its recent steps and sections took. From that, pure code here (the ledger feeds it; the
tests drive it with their own clock):

- :class:`SectionTimes` learns each section's timeout from the run's own observed times -- a
  safety factor over a high percentile, clamped to a floor and a ceiling -- after a few
  observations; an explicit ``failure.hang.timeout`` overrides it. A rank doing storage I/O
  (every rank restoring, rank 0 writing a checkpoint) is never timed out sooner than one storage
  request may take under the retry policy, and a completed request is progress: a long upload
  that moves is never a hang.
- :class:`HangDetector` declares a hang when a rank has made no progress for longer than its
  section's timeout and the whole group has gone quiet. The stalled rank is the one whose
  heartbeats stopped (a stopped or dead process), else the one that stopped progressing first.
- :class:`StragglerScores` scores each rank's local step time (its data wait and compute,
  without the time it waited for the others) against the fastest rank and its own best.
- :func:`restart_loop` tells when consecutive attempts keep failing without progress.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ftjob.config import HangConfig, RestartLoopConfig, StragglerConfig
from ftjob.policy.hang_rules import HANG, RankState, Stall, culprit, silent_after, timed_as
from ftjob.record import (
    Attempt,
    Beat,
    Hang,
    SectionTimeout,
    StackCapture,
    Straggler,
    StragglerReport,
    StragglerScore,
    WatchRecord,
    WorkerPlace,
)

# "data": a rank waiting for its next batch (its own learned timeout: decode start-up is slow);
# "step": its compute, until its gradients are ready.
SECTIONS = ("setup", "restore", "warmup", "data", "step", "validation", "checkpoint")
IO_SECTIONS = ("restore", "checkpoint")  # storage requests in flight: each completion is progress
UNTIMED = ("preempted", "done")  # waiting to be torn down after a notice, or finished


_HANG, _STRAGGLER, _LOOP = HangConfig(), StragglerConfig(), RestartLoopConfig()  # the defaults


@dataclass(frozen=True)
class HangPolicy:
    """``failure.hang`` (:class:`~ftjob.config.HangConfig`: its defaults and docs), with what
    the detector derives from the rest of the config."""

    enabled: bool = _HANG.enabled
    timeout: float | None = _HANG.timeout  # every section, when set; None = learned
    safety_factor: float = _HANG.safety_factor
    min_timeout: float = _HANG.min_timeout
    # A rank waiting for its batch: the first window of a stream starts decode processes,
    # seconds to minutes on a loaded node. A stopped process is found at min_timeout anyway
    # (its heartbeats stop); a stuck input pipeline after this floor, or its learned wait.
    data_min_timeout: float = 120.0
    max_timeout: float = _HANG.max_timeout
    warmup: int = _HANG.warmup  # observations of a section before its timeout is learned
    io_timeout: float = 0.0  # what one storage request may take under the retry policy
    heartbeat_interval: float = _HANG.heartbeat_interval
    percentile: float = 0.99

    @classmethod
    def from_config(cls, hang: HangConfig, retry: Any) -> HangPolicy:
        deadline = retry.deadline if retry.deadline is not None else hang.max_timeout
        return cls(
            enabled=hang.enabled,
            timeout=hang.timeout,
            safety_factor=hang.safety_factor,
            min_timeout=hang.min_timeout,
            max_timeout=hang.max_timeout,
            warmup=hang.warmup,
            io_timeout=deadline + retry.max_backoff,
            heartbeat_interval=hang.heartbeat_interval,
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class SectionTimes:
    """Observed durations per section, over every rank and attempt of the run."""

    def __init__(self, policy: HangPolicy, keep: int = 512) -> None:
        self.policy = policy
        self.observed: dict[str, deque[float]] = {}
        self.keep = keep

    def observe(self, section: str, seconds: list[float]) -> None:
        self.observed.setdefault(section, deque(maxlen=self.keep)).extend(seconds)

    def learned(self, section: str) -> bool:
        return len(self.observed.get(section, ())) >= self.policy.warmup

    def timeout(self, section: str, io: bool = False) -> float | None:
        """Seconds without progress after which ``section`` is stalled (None: never); ``io``:
        for a rank whose storage requests this section waits on."""
        p = self.policy
        if section in UNTIMED:
            return None
        if p.timeout is not None:
            value = p.timeout
        elif self.learned(section):
            high = _percentile(list(self.observed[section]), p.percentile)
            floor = max(p.min_timeout, p.data_min_timeout) if section == "data" else p.min_timeout
            value = min(max(p.safety_factor * high, floor), p.max_timeout)
        else:
            value = p.max_timeout
        return max(value, p.io_timeout) if io and section in IO_SECTIONS else value

    def table(self) -> dict[str, SectionTimeout]:
        return {
            s: SectionTimeout(
                observed=len(self.observed.get(s, ())),
                p99_s=_percentile(list(self.observed[s]), self.policy.percentile)
                if self.observed.get(s)
                else None,
                timeout_s=self.timeout(s, io=True),
                learned=self.policy.timeout is None and self.learned(s),
            )
            for s in SECTIONS
        }


class HangDetector:
    """The ranks of the current attempt and their progress; one hang at most per attempt,
    decided by :data:`~ftjob.policy.hang_rules.HANG` over the attempt's :class:`Stall`."""

    def __init__(self, policy: HangPolicy, times: SectionTimes) -> None:
        self.policy, self.times = policy, times
        self.attempt = -1
        self.ranks: dict[int, RankState] = {}
        self.declared = False

    def register(self, attempt: int, rank: int, node_id: str, pid: int, now: float) -> None:
        if attempt != self.attempt:
            self.attempt, self.ranks, self.declared = attempt, {}, False
        self.ranks[rank] = RankState(node_id, pid, progress=now, beat=now)

    def beat(self, attempt: int, rank: int, beat: Beat, now: float) -> None:
        state = self.ranks.get(rank)
        if attempt != self.attempt or state is None:
            return  # a late heartbeat of an earlier attempt
        for section, seconds in beat.durations.items():
            self.times.observe(section, seconds)
        state.section = beat.section
        state.step = beat.step
        state.beat = now
        state.progress = max(state.progress, now - beat.age)
        if state.section in IO_SECTIONS and state.io >= 0 and beat.io > state.io:
            state.progress = now  # a storage request completed: the section moves
        state.io = beat.io

    def stall(self, now: float) -> Stall:
        """The attempt's ranks at ``now``, each timed by its section."""
        silent = silent_after(self.policy.heartbeat_interval)
        timeouts = {}
        for rank, s in self.ranks.items():
            # Every rank restores from storage; rank 0 alone writes checkpoints, the others
            # wait for it (and are not blamed while it moves: the group rule).
            io = s.section == "restore" or (s.section == "checkpoint" and rank == 0)
            timeout = self.times.timeout(timed_as(s), io)
            if timeout is None:
                continue
            if now - s.beat > silent:
                # Its heartbeat thread went quiet too: the process is stopped or gone, not
                # waiting for data, slow peers or storage (uploads run beside the heartbeat
                # thread, which beats through them) -- the floor, not a learned wait, applies.
                timeout = min(timeout, self.policy.min_timeout)
            timeouts[rank] = timeout
        return Stall(now, self.ranks, timeouts, silent)

    def check(self, now: float) -> Hang | None:
        """A hang record the first time the attempt is stalled, else None."""
        if not self.policy.enabled or self.declared or not self.ranks:
            return None
        stall = self.stall(now)
        if not HANG(stall):
            return None
        self.declared = True
        rank = culprit(stall)
        s, timeout = self.ranks[rank], stall.overdue[rank]
        return Hang(
            time=now,
            attempt=self.attempt,
            rank=rank,
            node_id=s.node_id,
            pid=s.pid,
            section=s.section,
            step=s.step,
            stalled_since=s.progress,
            stalled_for_s=now - s.progress,
            timeout_s=timeout,
            detection_latency_s=now - s.progress - timeout,  # past the timeout
            learned=self.policy.timeout is None and self.times.learned(timed_as(s)),
            heartbeats_stopped=stall.stopped(rank),
            others={r: o.section for r, o in sorted(self.ranks.items()) if r != rank},
        )


class StragglerScores:
    """Per-rank local step times -> slowdown against the fastest rank and the rank's own best.
    A rank at or above ``threshold`` for ``patience`` checks in a row is a straggler."""

    def __init__(self, threshold: float, patience: int, window: int = 20) -> None:
        self.threshold, self.patience, self.window = threshold, patience, window
        self.attempt = -1
        self.times: dict[int, deque[float]] = {}
        self.best: dict[int, float] = {}
        self.streak: dict[int, list[float]] = {}
        self.flagged: list[Straggler] = []
        self.scores: dict[int, StragglerScore] = {}
        self.peak: dict[int, float] = {}  # per rank: its highest sustained slowdown
        self.history: dict[int, deque[float]] = {}  # per rank: its recent slowdowns
        self.fresh: set[int] = set()  # ranks with step times since the last check

    def add(self, attempt: int, rank: int, local_s: list[float]) -> None:
        if attempt != self.attempt:
            self.attempt, self.times, self.streak, self.fresh = attempt, {}, {}, set()
        self.times.setdefault(rank, deque(maxlen=self.window)).extend(local_s)
        self.fresh.add(rank)

    def check(self, now: float, where: dict[int, str], restart: bool = False) -> list[Straggler]:
        """New stragglers (once per rank and attempt); ``restart``: each is to be restarted."""
        full = {r: t for r, t in self.times.items() if len(t) >= self.window}
        if len(full) < 2 or not self.fresh >= full.keys():
            return []  # too few ranks, or one sent no steps since (stopped, or all waiting)
        self.fresh = set()
        medians = {r: statistics.median(t) for r, t in full.items()}
        fastest = min(medians.values())
        new = []
        for rank, median in medians.items():
            self.best[rank] = min(self.best.get(rank, median), median)
            slowdown = median / fastest if fastest > 0 else 1.0
            self.scores[rank] = StragglerScore(slowdown, median / self.best[rank])
            self.history.setdefault(rank, deque(maxlen=1000)).append(slowdown)
            streak = self.streak.setdefault(rank, [])
            streak[:] = [*streak, slowdown] if slowdown >= self.threshold else []
            if len(streak) >= self.patience:
                sustained = statistics.median(streak)
                self.peak[rank] = max(self.peak.get(rank, 0.0), sustained)
                if not any(f.rank == rank and f.attempt == self.attempt for f in self.flagged):
                    new.append(self._flag(rank, sustained, now, where.get(rank), restart))
        return new

    def _flag(
        self, rank: int, slowdown: float, now: float, node_id: str | None, restart: bool
    ) -> Straggler:
        record = Straggler(
            time=now,
            attempt=self.attempt,
            rank=rank,
            node_id=node_id,
            slowdown=slowdown,
            vs_own_best=self.scores[rank].vs_own_best,
            restarted=restart,
        )
        self.flagged.append(record)
        return record

    def max_slowdown(self) -> float:
        """The highest sustained slowdown of any rank; without a straggler, the highest
        median slowdown of a rank over the run (0.0 when no two ranks were ever scored)."""
        if self.peak:
            return max(self.peak.values())
        return max((statistics.median(h) for h in self.history.values()), default=0.0)


def restart_loop(attempts: Sequence[Attempt], loop_attempts: int, min_steps: int) -> str | None:
    """Why the run must stop, when the last ``loop_attempts`` finished attempts each failed
    before raising the run's high-water mark by ``min_steps`` steps; else None. ``attempts``
    are the ledger's, the newest (just started) one last; attempts ended by a preemption
    notice or a planned resize do not count."""
    if loop_attempts <= 0 or len(attempts) <= loop_attempts:
        return None
    ended = attempts[:-1]
    high = 0
    gains = []
    for attempt in ended:
        gains.append((attempt.max_step - high, attempt.planned_end))  # planned: no failure
        high = max(high, attempt.max_step)
    recent = gains[-loop_attempts:]
    if any(preempted or gain >= min_steps for gain, preempted in recent):
        return None
    return (
        f"restart loop: {loop_attempts} attempts in a row failed before training {min_steps} "
        f"step(s) past step {high}, the furthest the run got; stopped instead of spending the "
        "failure budget (failure.restart_loop.attempts, failure.restart_loop.min_steps)"
    )


@dataclass(frozen=True)
class WatchConfig:
    hang: HangPolicy
    straggler_threshold: float = _STRAGGLER.threshold
    straggler_patience: int = _STRAGGLER.patience
    straggler_action: str = _STRAGGLER.action  # none | restart
    restart_loop_attempts: int = _LOOP.attempts
    restart_loop_min_steps: int = _LOOP.min_steps

    @classmethod
    def from_job(cls, job: Any) -> WatchConfig:
        f = job.failure
        return cls(
            HangPolicy.from_config(f.hang, job.checkpoint.retry),
            f.straggler.threshold,
            f.straggler.patience,
            f.straggler.action,
            f.restart_loop.attempts,
            f.restart_loop.min_steps,
        )


@dataclass(frozen=True)
class SlowRank:
    """chaos=slow: the rank that sleeps ``fraction`` of each step, in ``attempt``."""

    attempt: int
    rank: int
    fraction: float


class RunWatch:
    """The run ledger's part that watches for hangs and stragglers, and steers chaos=slow."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.times = SectionTimes(config.hang)
        self.detector = HangDetector(config.hang, self.times)
        self.stragglers = StragglerScores(config.straggler_threshold, config.straggler_patience)
        self.hangs: list[Hang] = []
        self.slow: SlowRank | None = None
        self.phases: dict[int, dict[str, float]] = {}  # per attempt: rank 0's set-up phases

    def register(self, attempt: int, rank: int, place: WorkerPlace, now: float) -> None:
        self.detector.register(attempt, rank, place.node_id, place.pid, now)

    def beat(self, attempt: int, rank: int, beat: Beat, now: float) -> float:
        """Take a heartbeat; the answer: the share of each step this rank sleeps (chaos=slow)."""
        self.detector.beat(attempt, rank, beat, now)
        if rank == 0:  # how the attempt's start went: set-up, restore, warm-up to a first step
            phases = self.phases.setdefault(attempt, {})
            for section in ("setup", "restore", "warmup"):  # summed, should one come twice
                done = beat.durations.get(section)
                if done:
                    phases[section] = phases.get(section, 0.0) + sum(done)
        if beat.local:
            self.stragglers.add(attempt, rank, beat.local)
        slow = self.slow
        mine = slow is not None and slow.attempt == attempt and slow.rank == rank
        return slow.fraction if slow is not None and mine else 0.0

    def check(self, now: float) -> tuple[list[Hang | Straggler], list[str]]:
        """What the driver must act on now -- a hang, or a straggler to restart (with
        failure.straggler.action=restart) -- and the progress lines to print. New stragglers
        are recorded either way."""
        actions: list[Hang | Straggler] = []
        lines = []
        hang = self.detector.check(now)
        if hang is not None:
            self.hangs.append(hang)
            actions.append(hang)
            how = "learned" if hang.learned else "configured"
            lines.append(
                f"hang: rank {hang.rank} made no progress for {hang.stalled_for_s:.0f} s in "
                f"{hang.section} at step {hang.step} (timeout {hang.timeout_s:.0f} s, "
                f"{how}); capturing its stack and restarting the worker group"
            )
        where = {r: s.node_id for r, s in self.detector.ranks.items()}
        restart = self.config.straggler_action == "restart" and hang is None
        for record in self.stragglers.check(now, where, restart):
            line = (
                f"straggler: rank {record.rank} is {record.slowdown:.2f}x slower than the "
                f"fastest rank ({record.vs_own_best:.2f}x its own best)"
            )
            if record.restarted:
                pid = self.detector.ranks[record.rank].pid
                self.detector.declared = True  # the attempt ends: no hang on top of it
                actions.append(replace(record, pid=pid))
                line += "; restarting the worker group (failure.straggler.action=restart)"
            lines.append(line)
        return actions, lines

    def handled(self, time_of_hang: float, result: StackCapture) -> str:
        """The driver captured the stalled worker's stack and killed it: a progress line."""
        self.hangs = [h.handled(result) if h.time == time_of_hang else h for h in self.hangs]
        how = result.stack_source or "no stack"
        return f"hang: stack captured ({how}); worker pid {result.pid} killed"

    def snapshot(self) -> WatchRecord:
        scores = self.stragglers.scores
        return WatchRecord(
            hangs=tuple(self.hangs),
            stragglers=StragglerReport(
                flagged=tuple(self.stragglers.flagged),
                scores={str(r): scores[r] for r in sorted(scores)},
                max_slowdown=self.stragglers.max_slowdown(),
                threshold=self.config.straggler_threshold,
            ),
            sections=self.times.table(),
            phases={str(a): p for a, p in sorted(self.phases.items())},
        )
