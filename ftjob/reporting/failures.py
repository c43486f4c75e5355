"""Failure records: one per failure a run recovered from or died of -- where it came from and
what each part of the recovery cost -- read from the run ledger's snapshot (pure functions)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ftjob import metrics as M
from ftjob.record import Attempt, Failure, FirstStep, Holder, Notice, Restore, RunSnapshot, Tier
from ftjob.reporting.resizes import ended_by_resize
from ftjob.reporting.run_summary import (
    PREEMPTION,
    Detail,
    FailureRecord,
    InjectedDetail,
    PreemptionPart,
    Recovery,
)

NOT_FAILURES = ("hang", "slow")  # chaos that causes no failure itself (a hang is found, then ended)


class RecoveryEvent(NamedTuple):
    """What can take an attempt down: when, its kind (a failure record's), and its record."""

    time: float
    kind: str
    detail: Detail


def _recovery_events(snap: RunSnapshot) -> list[RecoveryEvent]:
    kills = [
        RecoveryEvent(
            k.deadline if k.deadline is not None else k.time,  # a preempted node goes then
            PREEMPTION if k.kind == "preempt" else f"{k.kind}_kill",
            k.target,
        )
        for k in snap.kills
        if k.kind not in NOT_FAILURES
    ]
    hangs = [  # a hang that ftjob ended (its worker killed) is the failure's origin
        RecoveryEvent(h.stalled_since, "hang", h) for h in snap.watch.hangs if h.killed
    ]
    restarted = [
        RecoveryEvent(s.time, "straggler", s) for s in snap.watch.stragglers.flagged if s.restarted
    ]
    injected = [RecoveryEvent(e.time, "injected", InjectedDetail(e.step)) for e in snap.injected]
    return sorted(kills + injected + hangs + restarted, key=lambda e: e.time)


def _start_phases(snap: RunSnapshot, attempt: int, first: FirstStep | None) -> dict[str, float]:
    """Inside an attempt's new workers (rank 0): set-up, restore, warm-up (its heartbeat
    sections), and their parts (process group, model; first batch, first step)."""
    return {**snap.watch.phases.get(str(attempt), {}), **(first.phases if first else {})}


def failure_records(snap: RunSnapshot) -> tuple[FailureRecord, ...]:
    """One record per failure: where it came from and how long each part of recovery took.

    Each attempt followed by another, unless a planned (elastic) resize ended it, ended by a
    failure; the next attempt is its recovery. Its failure is the first Ray Train noticed
    while it ran: a preempted attempt can have none (its node went as announced). A further
    notice in the same attempt is a restarted group that died before it began one (its own
    record, numbered as that attempt's failure, its time inside that failure's recovery).
    Times: detection (origin -> Ray Train noticed), restart (noticed -> new worker group in
    the train function), download/load/skip (restore), time_to_recover (origin -> first
    trained step). The origin: the chaos kill or injected failure behind it, else the moment
    noticed."""
    attempts = snap.attempts
    events, planned = _recovery_events(snap), ended_by_resize(snap)
    records = []
    for i, notice, errors, after in _ended(snap, planned):
        # (No attempt at all when every worker died before it could start one.)
        attempt = attempts[i] if 0 <= i < len(attempts) else None
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        if after is not None and notice is not None:
            records.append(_failed_restart(i, notice, errors, after, events, nxt))
            continue
        lo = attempt.started if attempt else 0.0
        hi = notice if notice is not None else (nxt.started if nxt else float("inf"))
        cause = [e for e in events if lo <= e.time <= hi]
        origin = cause[-1] if cause else None
        t0 = origin.time if origin else notice
        record = FailureRecord(
            attempt=i + 1,
            time=t0,
            kind=origin.kind if origin else "error",
            detail=origin.detail if origin else None,
            error=next(iter(errors.values()), None),
            detection_s=(notice - t0) if notice is not None and t0 is not None else None,
        )
        if nxt is not None:
            recovery = _recovery(snap, attempt, nxt, notice, t0)
            first = nxt.first_step is not None
            record = dataclasses.replace(record, recovery=recovery, recovered=first)
        if attempt is not None and attempt.preemption is not None:
            record = _as_preemption(record, attempt.preemption, nxt)
        records.append(record)
    return tuple(records)


Ended = tuple[int, float | None, dict[int, str], float | None]


def _ended(snap: RunSnapshot, planned: set[int]) -> list[Ended]:
    """(attempt position -- -1: before the first --, when Ray Train noticed the failure,
    the failed ranks' errors, the notice before it in the same attempt or None) for each
    failure, in order. An attempt that ended with none noticed: a preemption (its node went
    at the deadline), else the next attempt's start."""
    attempts = snap.attempts
    running: dict[int, list[Failure]] = {}
    for f in sorted(snap.failures, key=lambda f: f.noticed):
        running.setdefault(_running(f, attempts), []).append(f)
    ended: list[Ended] = []
    for i in range(-1, len(attempts)):
        mine = running.get(i, [])
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        if not mine and i >= 0 and nxt is not None and attempts[i].index not in planned:
            gone = attempts[i].preemption is not None
            ended.append((i, None if gone else nxt.started, {}, None))
        for k, f in enumerate(mine):
            ended.append((i, f.noticed, f.errors, mine[k - 1].noticed if k else None))
    return ended


def _running(f: Failure, attempts: tuple[Attempt, ...]) -> int:
    """The position of the attempt that ran when ``f`` was noticed: the ledger's own record
    of it; for a record kept before it had one, the last attempt started before."""
    if f.attempt is not None and 0 <= f.attempt < len(attempts):
        return f.attempt
    started = [i for i, a in enumerate(attempts) if a.started <= f.noticed]
    return started[-1] if started else -1


def _failed_restart(
    i: int,
    notice: float,
    errors: dict[int, str],
    after: float,
    events: list[RecoveryEvent],
    nxt: Attempt | None,
) -> FailureRecord:
    """A restarted group that died before it began an attempt (noticed at ``notice``, the
    notice before it at ``after``): its origin a chaos event between the two, else the
    notice; no recovery of its own -- its time is in the recovery of the failure before it,
    which the next attempt (``nxt``) ends."""
    cause = [e for e in events if after < e.time <= notice]
    origin = cause[-1] if cause else None
    t0 = origin.time if origin else notice
    return FailureRecord(
        attempt=i + 1,
        time=t0,
        kind=origin.kind if origin else "error",
        detail=origin.detail if origin else None,
        error=next(iter(errors.values()), None),
        detection_s=notice - t0,
        recovered=nxt is not None and nxt.first_step is not None,
    )


def _recovery(
    snap: RunSnapshot, attempt: Attempt | None, nxt: Attempt, notice: float | None, t0: float | None
) -> Recovery:
    """What recovering took, in the next attempt (``nxt``): its restart, restore, first step."""
    restored, first = nxt.restored, nxt.first_step
    restored_step = restored.step if restored else 0
    # An attempt that stopped at its start (the run lost to another driver) recovered nothing
    # here: what the failed one trained is the next driver's to restore, not lost.
    continued = nxt.continued_from is not None
    download = restored.download if restored else 0.0
    load = restored.load if restored else 0.0
    skip = restored.skip if restored else 0.0
    return Recovery(
        restart_s=nxt.started - notice if notice is not None else None,
        restored_step=restored_step,
        checkpoint=restored.path if restored else None,
        tier=restored.tier if restored else None,
        holder=_holder(restored),
        fallbacks=restored.skipped if restored else (),
        download_s=download,
        load_s=load,
        skip_s=skip,
        restoration_s=download + load + skip,
        lost_steps=max(0, (attempt.max_step if attempt else 0) - restored_step) if continued else 0,
        first_step_s=first.took if first else 0.0,
        time_to_recover_s=(first.time - t0) if first and t0 is not None else None,
        phases=_start_phases(snap, nxt.index, first),
        lost_window_s=_lost_window(snap, attempt, restored_step, t0),
    )


def _holder(restored: Restore | None) -> Holder | None:
    """Which copy the restore read: local | peer (a memory snapshot), storage; None for no
    restore, or a memory restore recorded without it."""
    if restored is None:
        return None
    if restored.holder is not None:
        return restored.holder
    return Holder.storage if restored.tier == Tier.storage else None


def _lost_window(
    snap: RunSnapshot, attempt: Attempt | None, restored_step: int, t0: float | None
) -> float | None:
    """The failed attempt's wall clock from the state the restore went back to (its start, or
    the restored checkpoint's upload when that attempt made it) to the failure's origin: the
    most the lost steps can have taken. Steps a dying worker still trained after the origin
    (a killed node's workers outlive their raylet by a moment) are in the detection time."""
    if attempt is None or t0 is None:
        return None
    since = attempt.started
    for c in snap.checkpoints:
        if c.committed and c.step == restored_step and c.time is not None:
            since = max(since, c.time - (c.seconds or 0.0))
    return max(0.0, t0 - since)


def _as_preemption(record: FailureRecord, preemption: Notice, nxt: Attempt | None) -> FailureRecord:
    """A notice came first: the attempt ended by preemption, whatever took it down. Its clock
    starts when the node went (the deadline; without one, when the notice came): detection is
    0 (the notice came in advance), restart runs from then to the new worker group."""
    t0 = preemption.deadline or preemption.received
    part = PreemptionPart(jit=preemption.jit, notice=dataclasses.replace(preemption, jit=None))
    record = dataclasses.replace(record, kind=PREEMPTION, time=t0, detection_s=0.0, preemption=part)
    if nxt is not None and record.recovery is not None:
        first = nxt.first_step
        recovery = dataclasses.replace(
            record.recovery,
            restart_s=nxt.started - t0,
            time_to_recover_s=first.time - t0 if first is not None else None,
        )
        record = dataclasses.replace(record, recovery=recovery)
    return record


def preemption_metrics(snap: RunSnapshot, failures: tuple[FailureRecord, ...]) -> dict[str, float]:
    noticed = [a.preemption for a in snap.attempts if a.preemption is not None]
    preempted = [f for f in failures if f.kind == PREEMPTION]
    return {
        M.PREEMPTION_COUNT: len(noticed),
        M.PREEMPTION_LOST_STEPS: sum(f.lost_steps for f in preempted),
        M.PREEMPTION_JIT_CHECKPOINT_TIME: sum(
            (n.jit.seconds or 0.0) if n.jit is not None else 0.0 for n in noticed
        ),
    }


def hang_metrics(snap: RunSnapshot) -> dict[str, float]:
    hangs = snap.watch.hangs
    return {
        M.HANG_COUNT: len(hangs),
        M.HANG_DETECTION_TIME: sum(h.stalled_for_s for h in hangs) / len(hangs) if hangs else 0.0,
        M.STRAGGLER_MAX_SLOWDOWN: snap.watch.stragglers.max_slowdown,
    }
