"""The run ledger's data part: the sample audit (``trainer.audit_samples``: every step's
samples, from every rank) and the files skipped as bad (``dataset.bad_files=skip``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ftjob.record import AuditStep, SkippedFile


@dataclass
class _StepSamples:
    epoch: int = 0
    ids: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


class SampleAudit:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.steps: dict[tuple[int, int], _StepSamples] = {}
        self.bad_files: dict[tuple[str, int], SkippedFile] = {}

    def step(self, attempt: int, step: int, epoch: int, ids: list[int], skipped: list[int]) -> None:
        """A rank's slice of a step: its samples, and those of them skipped (bad files)."""
        entry = self.steps.setdefault((attempt, step), _StepSamples())
        entry.epoch = epoch
        entry.ids.extend(ids)
        entry.skipped.extend(skipped)

    def skipped_files(self, attempt: int, rank: int, files: list[SkippedFile]) -> dict[str, int]:
        """Files a rank skipped; each said once for the run. The answer: how many samples of
        each split the run has skipped, every rank's, each once (the worker holds them to
        dataset.max_bad_fraction)."""
        for record in files:
            key = (record.split, record.id)
            if key in self.bad_files:
                continue
            self.bad_files[key] = SkippedFile(
                record.split, record.id, record.path, record.reason, attempt, rank
            )
            self.log(
                f"data: skipped {record.split} file {record.path} ({record.reason}); "
                "dataset.bad_files=skip leaves it out of every epoch"
            )
        counts: dict[str, int] = {}
        for split, _ in self.bad_files:
            counts[split] = counts.get(split, 0) + 1
        return counts

    def audited(self) -> tuple[AuditStep, ...]:
        return tuple(
            AuditStep(a, s, e.epoch, tuple(e.ids), tuple(e.skipped) if e.skipped else None)
            for (a, s), e in sorted(self.steps.items())
        )

    def files(self) -> tuple[SkippedFile, ...]:
        return tuple(self.bad_files[k] for k in sorted(self.bad_files))
