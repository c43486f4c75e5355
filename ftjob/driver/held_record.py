"""The run's record on the driver's side: pulled from the run ledger as the run goes, so that
whatever happens to Ray -- the ledger's actor gone with its raylet -- the driver still holds a
record at most a few seconds old to write summary.json from; and written to the run dir
(:class:`ftjob.reporting.run_record.RecordFile`), so that a driver killed outright leaves it
behind for ``python -m ftjob.report``."""

from __future__ import annotations

import dataclasses
import threading

from ftjob.record import AuditStep, RecordPull, RunSnapshot, merged_audit
from ftjob.reporting.run_record import RecordFile

PULL_EVERY_S = 2.0  # how stale the held record may be (and a committed checkpoint: at once)


class HeldRecord:
    """The newest pull of the ledger's record; its audit grown by each pull's new slices.
    Read from the thread that sees Ray die as well as from the driver's main thread."""

    def __init__(self, snapshot: RunSnapshot, file: RecordFile | None = None) -> None:
        self.snapshot = snapshot  # the ledger's, without its audit
        self.slices: list[AuditStep] = []
        self.cursor = 0  # the ledger's audit slices this record holds
        self.pulled: float | None = None  # when the ledger last answered a pull
        self.file = file
        self._lock = threading.Lock()

    def due(self, now: float) -> bool:
        return self.pulled is None or now - self.pulled >= PULL_EVERY_S

    def take(self, pull: RecordPull, now: float) -> None:
        """A pull's answer: the newest snapshot and the audit's slices since the last one,
        written to the run dir's record."""
        with self._lock:
            self.snapshot = pull.snapshot
            self.slices.extend(pull.audit)
            self.cursor, self.pulled = pull.cursor, now
            if self.file is not None:
                self.file.write(pull.snapshot, pull.audit, now)

    def record(self, fatal: str | None = None) -> RunSnapshot:
        """The record held now, with its audit; ``fatal``: why it ends here (the ledger's own
        fatal error, if it had one, stands)."""
        with self._lock:
            snapshot = dataclasses.replace(self.snapshot, audit=merged_audit(self.slices))
        if fatal is not None and snapshot.fatal is None:
            snapshot = dataclasses.replace(snapshot, fatal=fatal)
        return snapshot

    def end(self, status: str, now: float) -> None:
        """The driver wrote summary.json: the record says that it ended."""
        with self._lock:
            if self.file is not None:
                self.file.end(status, now)
