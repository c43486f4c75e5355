"""How a run ended: the terminal state of its training as the driver saw it, with its reasons
(:class:`FitEnd`), and the run's status decided from it and the run's record
(:func:`decide_status`, a pure function: every verdict is recomputed in tests without Ray).

The terminal states are named as Ray Train's controller names its own (``ErroredState``,
``FinishedState``, ``AbortedState`` in ``ray.train.v2._internal.execution.controller.state``):
an Enum whose members carry what they mean -- here the status a run ends with when nothing in
its record outranks it -- and a state object carrying the reasons.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ftjob.record import RunSnapshot, RunStatus
from ftjob.reporting.audit import audit_report


class RunEnd(enum.Enum):
    """Where a run's training ended; ``status``: the run's, unless its record outranks it
    (None: the record decides -- a fatal error, the last step, the audit)."""

    FINISHED = ("finished", None)  # fit() returned
    ERRORED = ("errored", RunStatus.failed)  # fit() raised (not one of the below)
    FAILURES_EXHAUSTED = ("failures_exhausted", RunStatus.failed)  # past failure.max_failures
    PREEMPTIONS_EXHAUSTED = ("preemptions_exhausted", RunStatus.failed)  # past max_preemptions
    CONTROLLER_FAILED = ("controller_failed", RunStatus.failed)  # Ray Train's controller
    INTERRUPTED = ("interrupted", RunStatus.interrupted)  # Ctrl-C
    PREEMPTED = ("preempted", RunStatus.preempted)  # a notice to the driver (SIGTERM)
    RAY_DIED = ("ray_died", RunStatus.failed)  # the Ray the run used died under it

    def __init__(self, state_name: str, status: RunStatus | None) -> None:
        self.state_name = state_name
        self.status = status


@dataclass(frozen=True)
class FitEnd:
    """The terminal state of a run's training, and its reasons."""

    state: RunEnd = RunEnd.FINISHED
    error: str | None = None  # the root error, one line (or why Ray died)
    stopped_at: str | None = None  # Ctrl-C or a notice before training: where the run stood


def decide_status(
    snap: RunSnapshot, end: FitEnd, max_failures: int, max_preemptions: int = -1
) -> tuple[RunStatus, str | None]:
    """How the run ended, and why (one line; None when it succeeded). A run succeeds only when
    fit() returned, no rank declared the job fatally failed, the last step was trained and,
    when audited, every sample was trained exactly once."""
    state = end.state
    if state is RunEnd.INTERRUPTED:
        return (
            RunStatus.interrupted,
            f"interrupted (Ctrl-C) {end.stopped_at or 'before the last step'}",
        )
    if state is RunEnd.PREEMPTED:
        return RunStatus.preempted, f"stopped by a preemption notice (SIGTERM) {_saved(snap, end)}"
    if state is RunEnd.PREEMPTIONS_EXHAUSTED:
        count = sum(1 for a in snap.attempts if a.preemption is not None)
        return RunStatus.failed, (
            f"training stopped after {count} preemption(s), over the budget "
            f"failure.max_preemptions={max_preemptions}: {end.error}"
        )
    if snap.fatal:  # ftjob stopped the job (a failure after it is its consequence)
        return RunStatus.failed, snap.fatal
    if state is RunEnd.FAILURES_EXHAUSTED:
        return RunStatus.failed, (
            f"training failed after {len(snap.failures)} failure(s), over the budget "
            f"failure.max_failures={max_failures}: {end.error}"
        )
    if state.status is not None:  # errored, Ray Train's controller, Ray died
        return state.status, end.error
    if snap.finished is None:
        return RunStatus.failed, "training ended before the last epoch"
    broken = [a for a in (audit_report(snap) if snap.audit else ()) if not a.exactly_once]
    if broken:
        a = broken[0]
        return RunStatus.failed, (
            f"exact-once broken: epoch {a.epoch} trained {a.duplicates} duplicate, "
            f"{a.missing} missing and {a.unexpected} unexpected sample(s), "
            f"{a.misplaced} step(s) not on their global batch "
            f"({len(broken)} epoch(s) affected; see summary.json audit)"
        )
    return RunStatus.succeeded, None


def _saved(snap: RunSnapshot, end: FitEnd) -> str:
    """Where a preempted run stands: before training, or with or without its just-in-time
    checkpoint."""
    if end.stopped_at:
        return end.stopped_at
    notice = snap.attempts[-1].preemption if snap.attempts else None
    jit = notice.jit if notice is not None else None
    if jit and jit.path:
        return f"after a just-in-time checkpoint of step {jit.step}"
    return "without a just-in-time checkpoint" + (f" ({jit.reason})" if jit and jit.reason else "")
