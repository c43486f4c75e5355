"""Every call a training worker makes to the run ledger, typed, with who makes it.

The run ledger (a Ray actor in production, a plain :class:`~ftjob.driver.ledger.RunLedger` in
tests) keeps the run's record outside the workers, so it survives any kill. Workers only talk
to it through a :class:`RunRecorder`: each method says what it records, and whether every rank
sends it or only rank 0 (on other ranks those methods do nothing, so the loop does not branch
on rank). Calls that record are fire and forget; calls that ask (``start_attempt``,
``claim_injected_failure``, ``notice_request``, ``heartbeat``) wait for the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class JobStopped(Exception):  # noqa: N818 -- what happened, not an error of the code
    """The job must stop on every rank together (divergence, the upload budget spent, no
    checkpoint that verifies, a run taken over, a file that cannot be decoded): the run
    ledger holds the reason, which becomes the run's error; no Ray Train retry would fare
    better."""


class RunRecorder:
    """``ledger``: a handle whose methods have ``.remote(*args)``; ``resolve`` turns what
    ``.remote`` returned into the answer (``ray.get`` for an actor)."""

    def __init__(
        self, ledger: Any, rank: int, resolve: Callable[..., Any], attempt: int = -1
    ) -> None:
        self.ledger, self.rank, self._resolve = ledger, rank, resolve
        self.attempt = attempt

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _tell(self, name: str, *args: Any) -> None:
        getattr(self.ledger, name).remote(*args)

    def _ask(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        return self._resolve(getattr(self.ledger, name).remote(*args), timeout=timeout)

    # -- asked: the answer steers the worker ---------------------------------------------------

    def start_attempt(self, world: int, started: float) -> dict[str, Any] | None:
        """Rank 0: this attempt's index (it started at ``started``, wall clock), and why it
        must not train (None on other ranks: the caller broadcasts rank 0's answer)."""
        return self._ask("start_attempt", started, world) if self.leader else None

    def claim_injected_failure(self, step: int) -> bool:
        """Rank 0: is an injected failure (chaos.fail_at_steps) due at this step?"""
        return self.leader and bool(self._ask("claim_injected_failure", step, time.time()))

    def notice_request(self) -> str | None:
        """What the driver asks of the workers now: a stop (SIGTERM to it), a resize."""
        return self._ask("notice_request", timeout=10)

    def heartbeat(self, beat: dict[str, Any]) -> dict[str, Any]:
        """Every rank, about once a second; the answer steers chaos=slow."""
        return self._ask("heartbeat", self.attempt, self.rank, beat, timeout=10) or {}

    # -- recorded by every rank ------------------------------------------------------------------

    def register(self, where: dict[str, Any]) -> None:
        """Where this rank runs (node, pid, raylet pid): chaos and hang handling target it."""
        self._tell("register_worker", self.attempt, self.rank, {**where, "time": time.time()})

    def audit_step(self, step: int, epoch: int, ids: list[int], skipped: list[int]) -> None:
        """This rank's slice of a step: every sample of it, and those skipped (bad files)."""
        self._tell("audit_step", self.attempt, step, epoch, ids, skipped)

    def skipped_files(self, records: list[dict[str, Any]]) -> None:
        """Files this rank skipped (dataset.bad_files=skip): split, id, path, reason."""
        self._tell("skipped_files", self.attempt, self.rank, records)

    def storage_stats(self, source: str, stats: dict[str, Any]) -> None:
        self._tell("storage_stats", source, stats)

    def data_error(self, error: str) -> None:
        """Any rank that met a file that cannot be decoded: the run's fatal error."""
        self._ask("set_fatal", error, timeout=60)

    # -- recorded by rank 0 ------------------------------------------------------------------------

    def _lead(self, name: str, *args: Any) -> None:
        if self.leader:
            self._tell(name, *args)

    def fatal(self, error: str) -> JobStopped:
        """The job must stop (every rank agreed): rank 0 records why; raise what it returns."""
        self._lead("set_fatal", error)
        return JobStopped(error)

    def log(self, line: str) -> None:
        self._lead("log", line)

    def restored(self, info: dict[str, Any]) -> None:
        self._lead("restored", self.attempt, info)

    def step_done(self, step: int) -> None:
        self._lead("step_done", self.attempt, step)

    def first_step(self, step: int, took: float, phases: dict[str, float]) -> None:
        self._lead("first_step", self.attempt, step, time.time(), took, phases)

    def progress(self, progress: dict[str, Any], metrics: dict[str, float]) -> None:
        self._lead("progress_update", self.attempt, {**progress, "time": time.time()}, metrics)

    def validation(self, step: int, result: dict[str, Any]) -> None:
        self._lead("validation", self.attempt, step, result)

    def checkpoint(self, record: dict[str, Any]) -> None:
        """An upload's outcome, the moment it ends (any thread of rank 0)."""
        self._lead("checkpoint", self.attempt, {**record, "time": time.time()})

    def preemption_notice(self, record: dict[str, Any]) -> None:
        self._lead("preemption_notice", self.attempt, record)

    def jit_checkpoint(self, record: dict[str, Any]) -> None:
        self._lead("jit_checkpoint", self.attempt, {**record, "time": time.time()})

    def finish(self) -> None:
        self._lead("finish", time.time())
