"""Every call a training worker makes to the run ledger, typed, with who makes it.

The run ledger (a Ray actor in production, a plain :class:`~ftjob.driver.ledger.RunLedger` in
tests) keeps the run's record outside the workers, so it survives any kill. Workers only talk
to it through a :class:`RunRecorder`: each method says what it records, and whether every rank
sends it or only rank 0 (on other ranks those methods do nothing, so the loop does not branch
on rank). Calls that record are fire and forget; calls that ask (``start_attempt``,
``claim_injected_failure``, ``notice_request``, ``heartbeat``) wait for the answer.

Each call names the ledger's method as a method of :class:`~ftjob.record.WorkerLedger` (not
as a string, :mod:`ftjob.actors`), so the type checker holds every call to the ledger's
signature.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ftjob.actors import Actor, Fetch, Method, call, tell
from ftjob.record import (
    AttemptStart,
    Beat,
    CheckpointRecord,
    DecodeChoice,
    FirstStep,
    JitCheckpoint,
    Notice,
    NoticeSource,
    Progress,
    Restore,
    SkippedFile,
    StorageCounters,
    ValidationResult,
    WorkerLedger,
    WorkerPlace,
)

P = ParamSpec("P")
T = TypeVar("T")
AUDIT_TIMEOUT_S = 60.0  # a ledger that has not taken a step's slice by then is gone


class JobStopped(Exception):  # noqa: N818 -- what happened, not an error of the code
    """The job must stop on every rank together (divergence, the upload budget spent, no
    checkpoint that verifies, a run taken over, a file that cannot be decoded): the run
    ledger holds the reason, which becomes the run's error; no Ray Train retry would fare
    better."""


class RunRecorder:
    """``ledger``: the run ledger's handle; ``resolve`` turns what a call gave into the answer
    (``ray.get`` for a Ray actor, :func:`~ftjob.actors.answered` for a direct handle)."""

    def __init__(
        self, ledger: Actor[WorkerLedger], rank: int, resolve: Fetch, attempt: int = -1
    ) -> None:
        self.ledger = ledger
        self.rank = rank
        self._resolve = resolve
        self.attempt = attempt

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _tell(
        self, method: Method[WorkerLedger, P, None], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        tell(self.ledger, method, *args, **kwargs)

    def _ask(
        self,
        method: Method[WorkerLedger, P, T],
        timeout: float | None,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        return self._resolve(call(self.ledger, method, *args, **kwargs), timeout=timeout)

    # -- asked: the answer steers the worker ---------------------------------------------------

    def start_attempt(self, world: int, started: float) -> AttemptStart | None:
        """Rank 0: this attempt's index (it started at ``started``, wall clock), and why it
        must not train (None on other ranks: the caller broadcasts rank 0's answer)."""
        if not self.leader:
            return None
        return self._ask(WorkerLedger.start_attempt, None, started, world)

    def claim_injected_failure(self, step: int) -> bool:
        """Rank 0: is an injected failure (chaos.fail_at_steps) due at this step?"""
        if not self.leader:
            return False
        return self._ask(WorkerLedger.claim_injected_failure, None, step, time.time())

    def notice_request(self) -> NoticeSource | None:
        """What the driver asks of the workers now: a stop (SIGTERM to it), a resize."""
        return self._ask(WorkerLedger.notice_request, 10)

    def decode_choice(self, proposed: DecodeChoice | None) -> DecodeChoice | None:
        """Rank 0: where the run's batches decode -- ``proposed`` kept if the run has no
        choice yet (None on other ranks: the caller broadcasts rank 0's answer)."""
        if not self.leader:
            return None
        return self._ask(WorkerLedger.decode_choice, 30, proposed)

    def heartbeat(self, beat: Beat) -> float:
        """Every rank, about once a second; the answer: the share of each step to sleep
        (chaos=slow)."""
        return self._ask(WorkerLedger.heartbeat, 10, self.attempt, self.rank, beat)

    # -- recorded by every rank ------------------------------------------------------------------

    def register(self, where: WorkerPlace) -> None:
        """Where this rank runs (node, pid, raylet pid): chaos and hang handling target it."""
        place = dataclasses.replace(where, time=time.time())
        self._tell(WorkerLedger.register_worker, self.attempt, self.rank, place)

    def audit_step(
        self, step: int, epoch: int, ids: list[int], skipped: list[int]
    ) -> Callable[[], None]:
        """This rank's slice of a step: every sample of it, and those skipped (bad files),
        sent as the step starts. The answer: a wait, called before the step's gradients are
        all-reduced, until the ledger holds the slice -- so a step that any rank completed
        (and could snapshot) has every rank's slice on record. A slice sent after the step
        was lost with a rank killed between the all-reduce and its report, while the step
        survived in the other ranks' snapshot: a hole in the audit of a step trained once."""
        ref = call(self.ledger, WorkerLedger.audit_step, self.attempt, step, epoch, ids, skipped)
        return lambda: self._resolve(ref, timeout=AUDIT_TIMEOUT_S)

    def skipped_files(self, files: list[SkippedFile]) -> dict[str, int]:
        """Files this rank skipped (dataset.bad_files=skip): split, id, path, reason; the
        answer: the bad samples of each split the run has met (dataset.max_bad_fraction)."""
        return self._ask(WorkerLedger.skipped_files, 60, self.attempt, self.rank, files)

    def storage_stats(self, source: str, stats: StorageCounters) -> None:
        self._tell(WorkerLedger.storage_stats, source, stats)

    def data_error(self, error: str) -> None:
        """Any rank that met an error every attempt would meet again (a file that cannot be
        decoded, an op exact mode cannot run): the run's fatal error."""
        self._ask(WorkerLedger.set_fatal, 60, error)

    # -- recorded by rank 0 ------------------------------------------------------------------------

    def _lead(
        self, method: Method[WorkerLedger, P, None], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        if self.leader:
            self._tell(method, *args, **kwargs)

    def fatal(self, error: str) -> JobStopped:
        """The job must stop (every rank agreed): rank 0 records why; raise what it returns."""
        self._lead(WorkerLedger.set_fatal, error)
        return JobStopped(error)

    def log(self, line: str) -> None:
        self._lead(WorkerLedger.log, line)

    def restored(self, restore: Restore) -> None:
        self._lead(WorkerLedger.restored, self.attempt, restore)

    def step_done(self, step: int) -> None:
        self._lead(WorkerLedger.step_done, self.attempt, step)

    def first_step(self, step: int, took: float, phases: dict[str, float]) -> None:
        first = FirstStep(step=step, time=time.time(), took=took, phases=phases)
        self._lead(WorkerLedger.first_step, self.attempt, first)

    def progress(self, progress: Progress, metrics: dict[str, float]) -> None:
        point = dataclasses.replace(progress, time=time.time())
        self._lead(WorkerLedger.progress_update, self.attempt, point, metrics)

    def validation(self, step: int, result: ValidationResult) -> None:
        self._lead(WorkerLedger.validation, self.attempt, step, result)

    def checkpoint(self, record: CheckpointRecord) -> None:
        """An upload's outcome, the moment it ends (any thread of rank 0)."""
        stamped = dataclasses.replace(record, time=time.time())
        self._lead(WorkerLedger.checkpoint, self.attempt, stamped)

    def preemption_notice(self, notice: Notice) -> None:
        self._lead(WorkerLedger.preemption_notice, self.attempt, notice)

    def jit_checkpoint(self, record: JitCheckpoint) -> None:
        stamped = dataclasses.replace(record, time=time.time())
        self._lead(WorkerLedger.jit_checkpoint, self.attempt, stamped)

    def finish(self) -> None:
        self._lead(WorkerLedger.finish, time.time())
