"""The run ledger's training record: progress points, validations, checkpoints, and the feed
of step records for the experiment loggers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ftjob.driver.ledger.pace import PacePoint, pace, pace_point
from ftjob.metrics import fmt
from ftjob.record import (
    CheckpointRecord,
    HistoryPoint,
    LogFeed,
    Progress,
    StepRecord,
    ValidationResult,
)


class StepLog:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.progress: Progress | None = None
        self.metrics: dict[str, float] = {}
        self.validations: dict[int, ValidationResult] = {}
        self.replaced_validations = 0  # steps validated again after a restore
        self.checkpoints: list[CheckpointRecord] = []
        self.records: list[StepRecord] = []  # for the experiment loggers, append-only
        self.history: dict[int, HistoryPoint] = {}  # step -> its progress point that survived
        self.pace_point: PacePoint | None = None  # the last progress point, for the ETA

    def progress_update(
        self, attempt: int, progress: Progress, metrics: dict[str, float], world: int | None
    ) -> None:
        self.progress = dataclasses.replace(progress, attempt=attempt)
        self.metrics = dict(metrics)
        values = {"loss": progress.loss, "throughput": progress.throughput, "lr": progress.lr}
        self.records.append(StepRecord("train", attempt, progress.step, values))
        self.history[progress.step] = HistoryPoint(
            progress.step, progress.time, attempt, **values, world_size=world
        )
        p = progress
        point = pace_point(attempt, progress, metrics)
        now = pace(self.pace_point, point, p.total_steps)
        self.pace_point = point
        self.log(
            f"epoch {p.epoch + 1}/{p.epochs} step {p.step}/{p.total_steps} "
            f"loss {fmt(p.loss)} | {fmt(p.throughput, '.0f')} img/s{now.text()}"
        )

    def validation(self, attempt: int, step: int, result: ValidationResult) -> None:
        if step in self.validations:
            self.replaced_validations += 1  # the step was trained again after a restore
        self.validations[step] = dataclasses.replace(result, step=step, attempt=attempt)
        values: dict[str, float | None] = {"loss": result.loss, "accuracy": result.accuracy}
        self.records.append(StepRecord("validation", attempt, step, values))
        self.log(
            f"validation at step {step}: loss {fmt(result.loss)}, accuracy {fmt(result.accuracy)}"
        )

    def checkpoint(self, attempt: int, record: CheckpointRecord) -> None:
        self.checkpoints.append(dataclasses.replace(record, attempt=attempt))
        if record.committed:
            self.log(f"checkpoint step {record.step} committed ({record.seconds:.2f}s)")
        else:
            self.log(f"checkpoint step {record.step} upload FAILED: {record.error}")

    def feed(self, cursor: int, finished: bool) -> LogFeed:
        """Step records since ``cursor``, and the step up to which records are settled (no
        restore can go back before a committed checkpoint)."""
        committed = [c.step for c in self.checkpoints if c.committed]
        settled = math.inf if finished else max(committed, default=0)
        records = tuple(self.records[cursor:])
        return LogFeed(records=records, cursor=cursor + len(records), settled=settled)

    def validations_in_order(self) -> tuple[ValidationResult, ...]:
        return tuple(self.validations[s] for s in sorted(self.validations))

    def history_in_order(self) -> tuple[HistoryPoint, ...]:
        return tuple(self.history[s] for s in sorted(self.history))
