"""The run ledger's attempts: one record per worker group, from its start to its end."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ftjob.record import (
    Attempt,
    FirstStep,
    JitCheckpoint,
    Notice,
    NoticeSource,
    ResizeRequest,
    Restore,
    RunPlan,
    WorkerPlace,
)
from ftjob.reporting.resizes import describe_restart
from ftjob.worker.preemption import describe_jit, describe_notice


class Attempts:
    """Every attempt of the run, the newest last. Records are frozen: a change replaces the
    attempt's record."""

    def __init__(self, plan: RunPlan, log: Callable[[str], None]) -> None:
        self.plan = plan
        self.log = log
        self.records: list[Attempt] = []

    @property
    def latest(self) -> Attempt | None:
        return self.records[-1] if self.records else None

    def __getitem__(self, index: int) -> Attempt:
        return self.records[index]

    def _update(self, index: int, **changes: Any) -> Attempt:  # Attempt's fields: replace checks
        self.records[index] = dataclasses.replace(self.records[index], **changes)
        return self.records[index]

    def begin(self, now: float, world: int | None) -> int:
        index = len(self.records)
        previous = self.latest
        self.records.append(Attempt(index=index, started=now, world_size=world))
        if index:
            before = previous.world_size if previous else None
            self.log(
                f"attempt {index + 1}: {describe_restart(before, world, self.plan.num_workers)}"
            )
        return index

    def register(self, attempt: int, rank: int, place: WorkerPlace) -> None:
        workers = {**self.records[attempt].workers, rank: place}
        self._update(attempt, workers=workers)

    def reached(self, attempt: int, step: int) -> None:
        """The attempt trained up to ``step``: its high-water mark, for lost-work accounting."""
        if step > self.records[attempt].max_step:
            self._update(attempt, max_step=step)

    def restored(self, attempt: int, restore: Restore) -> None:
        self._update(attempt, restored=restore)
        self.reached(attempt, restore.step)
        for bad in restore.skipped:
            self.log(f"checkpoint at step {bad.step} is not usable ({bad.reason}): fell back")
        self.log(
            f"restored step {restore.step} (epoch {restore.epoch + 1}, sample {restore.position}) "
            f"from {restore.path}: download {restore.download:.2f}s, load {restore.load:.2f}s, "
            f"skip {restore.skip:.3f}s"
        )

    def first_step(self, attempt: int, first: FirstStep) -> None:
        if self.records[attempt].first_step is None:
            self._update(attempt, first_step=first)

    def notice(self, attempt: int, notice: Notice, resize: ResizeRequest | None) -> None:
        """Every rank agreed on a notice: a preemption, or the planned resize ``resize``."""
        if notice.source == NoticeSource.resize:
            if resize is not None:
                notice = dataclasses.replace(
                    notice, from_=resize.from_, to=resize.to, requested=resize.requested
                )
            self._update(attempt, resize=notice)
        else:
            self._update(attempt, preemption=notice)
        for line in describe_notice(notice):
            self.log(line)

    def jit_checkpoint(self, attempt: int, record: JitCheckpoint) -> None:
        a = self.records[attempt]
        if a.resize is not None:
            self._update(attempt, resize=dataclasses.replace(a.resize, jit=record))
        else:  # a notice always comes first; should its record be lost, keep the checkpoint's
            notice = a.preemption or Notice(NoticeSource.driver, record.time or 0.0, record.step)
            self._update(attempt, preemption=dataclasses.replace(notice, jit=record))
        self.log(describe_jit(record))

    def resize_became_stop(self, executed: list[float]) -> None:
        """A stop came while the latest attempt checkpointed for a resize not yet carried
        out: that checkpoint is the stop notice's."""
        latest = self.latest
        if latest is None or latest.resize is None or latest.preemption is not None:
            return
        if any(t >= latest.started for t in executed):
            return
        notice = dataclasses.replace(latest.resize, source=NoticeSource.driver)
        self._update(latest.index, preemption=notice, resize=None)
