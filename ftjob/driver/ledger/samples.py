"""The run ledger's data part: the sample audit (``trainer.audit_samples``: every step's
samples, from every rank) and the files skipped as bad (``dataset.bad_files=skip``)."""

from __future__ import annotations

from collections.abc import Callable

from ftjob.record import AuditStep, SkippedFile, merged_audit


class SampleAudit:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        # Each rank's slice of a step as it came, never changed: the driver pulls what came
        # since its last pull (:meth:`since`), not the whole audit again.
        self.slices: list[AuditStep] = []
        self.bad_files: dict[tuple[str, int], SkippedFile] = {}

    def step(self, attempt: int, step: int, epoch: int, ids: list[int], skipped: list[int]) -> None:
        """A rank's slice of a step: its samples, and those of them skipped (bad files)."""
        self.slices.append(AuditStep(attempt, step, epoch, tuple(ids), tuple(skipped) or None))

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
        return merged_audit(self.slices)

    def since(self, cursor: int) -> tuple[tuple[AuditStep, ...], int]:
        """The slices that came since ``cursor``, and the cursor after them."""
        return tuple(self.slices[cursor:]), len(self.slices)

    def files(self) -> tuple[SkippedFile, ...]:
        return tuple(self.bad_files[k] for k in sorted(self.bad_files))
