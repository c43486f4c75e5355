"""The run's record as its driver keeps it in the run dir, ``run_record.jsonl``: what is left
of a run whose driver did not end (SIGKILL, its node gone), and what ``python -m ftjob.report``
rebuilds that run's summary from.

One JSON object a line, appended as the run goes, so a driver killed mid-write leaves at most
its last line torn (a reader skips it):

- ``{"start": RecordStart}``: what the driver knew from its start (name, config, resume command);
- ``{"snapshot": RunSnapshot, "time": t}``: the run ledger's snapshot without its audit, at
  most every few seconds and at every committed checkpoint, when it changed; the newest wins;
- ``{"audit": [AuditStep, ...]}``: each rank's slice of a step as the ledger received it, once;
- ``{"end": {"status": ..., "time": t}}``: the driver wrote its summary.json.

Snapshots that a newer one replaced are dropped now and then (the file rewritten without them,
by rename), so the file holds about the record's own size however long the run is.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from ftjob.record import AuditStep, Record, RunSnapshot, RunStatus, merged_audit
from ftjob.reporting.run_summary import RunSummary
from ftjob.reporting.summary import build_summary

RECORD_FILE = "run_record.jsonl"
COMPACT_AFTER = 4 * 2**20  # bytes of replaced snapshots past which the file is rewritten


@dataclass(frozen=True)
class RecordStart(Record):
    """What a driver knows of its run from its start."""

    name: str
    started: float  # when the driver started: goodput's and the timeline's clock
    config: dict[str, object] = field(default_factory=dict)  # the public config (redacted)
    resume_command: str | None = None  # the command that continues the run from storage


@dataclass(frozen=True)
class RecordEnd(Record):
    """The driver ended: it wrote the run's summary.json."""

    status: str
    time: float


@dataclass(frozen=True)
class KeptRecord:
    """A run's record as read back from its run dir."""

    start: RecordStart
    snapshot: RunSnapshot  # the newest snapshot, with every audit slice merged in
    written: float  # when its newest snapshot was written
    end: RecordEnd | None  # None: the driver did not end


class RecordFile:
    """Appends the run's record to ``run_dir/run_record.jsonl``; ``clean`` scrubs each line
    (the run's secrets: workers' error texts may hold one)."""

    def __init__(
        self, run_dir: str, start: RecordStart, clean: Callable[[str], str] = lambda t: t
    ) -> None:
        self.path = os.path.join(run_dir, RECORD_FILE)
        self.clean = clean
        self.last = ""  # the newest snapshot line written
        self.replaced = 0  # bytes of snapshot lines a newer one replaced
        with open(self.path, "w") as f:
            f.write(self._line({"start": start.to_json()}))

    def _line(self, data: dict[str, object]) -> str:
        return self.clean(json.dumps(data, separators=(",", ":"))) + "\n"

    def write(self, snapshot: RunSnapshot, audit: Sequence[AuditStep], now: float) -> None:
        """The audit's new slices, and ``snapshot`` (its audit left out) when it changed."""
        lines = [self._line({"audit": [s.to_json() for s in audit]})] if audit else []
        body = json.dumps(replace(snapshot, audit=()).to_json(), separators=(",", ":"))
        if body != self.last:
            lines.append(self.clean(f'{{"time":{now!r},"snapshot":{body}}}') + "\n")
            self.replaced += len(self.last)
            self.last = body
        if lines:
            with open(self.path, "a") as f:
                f.write("".join(lines))
        if self.replaced > COMPACT_AFTER:
            self._compact()

    def end(self, status: str, now: float) -> None:
        with open(self.path, "a") as f:
            f.write(self._line({"end": RecordEnd(status, now).to_json()}))

    def _compact(self) -> None:
        """The file again without the snapshots a newer one replaced (by rename: a reader, or
        a kill meanwhile, sees the old file or the new one, whole)."""
        newest = sum(1 for line in _lines(self.path) if line.startswith('{"time":'))
        tmp = self.path + ".tmp"
        seen = 0
        with open(tmp, "w") as out:
            for line in _lines(self.path):
                if line.startswith('{"time":'):
                    seen += 1
                    if seen < newest:
                        continue
                out.write(line)
        os.replace(tmp, self.path)
        self.replaced = 0


def _lines(path: str) -> Iterator[str]:
    with open(path) as f:
        yield from f


def read_record(run_dir: str) -> KeptRecord | None:
    """The record a driver kept in ``run_dir``; None when it kept none. A torn last line (the
    driver killed while writing it) is left out."""
    path = os.path.join(run_dir, RECORD_FILE)
    if not os.path.isfile(path):
        return None
    start: RecordStart | None = None
    snapshot, written, end = RunSnapshot(), 0.0, None
    slices: list[AuditStep] = []
    for line in _lines(path):
        try:
            data = json.loads(line)
        except ValueError:
            continue  # torn: the driver was killed while writing it
        if "start" in data:
            start = RecordStart.from_json(data["start"])
        elif "snapshot" in data:
            snapshot, written = RunSnapshot.from_json(data["snapshot"]), float(data["time"])
        elif "audit" in data:
            slices.extend(AuditStep.from_json(s) for s in data["audit"])
        elif "end" in data:
            end = RecordEnd.from_json(data["end"])
    if start is None:
        return None
    snapshot = replace(snapshot, audit=merged_audit(slices))
    return KeptRecord(start, snapshot, written or start.started, end)


def not_ended_error(kept: KeptRecord) -> str:
    """The error of a run whose driver did not end, as its rebuilt summary says it."""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(kept.written))
    return (
        f"the driver did not end (killed, or its machine lost): this summary is rebuilt from "
        f"its record ({RECORD_FILE}), last written at {at}, "
        f"{kept.written - kept.start.started:.0f} s after it started; the run's committed "
        "checkpoints are in its storage"
    )


def rebuilt_summary(kept: KeptRecord) -> RunSummary:
    """The summary of a run whose driver did not end, from the record it kept: failed, its
    figures as of the record's last write, the newest checkpoint the record saw committed,
    and the command that continues the run."""
    start = kept.start
    summary = build_summary(
        kept.snapshot,
        name=start.name,
        status=RunStatus.failed,
        error=not_ended_error(kept),
        wall_time_s=max(0.0, kept.written - start.started),
        config=dict(start.config),
        run_started=start.started,
    )
    if summary.checkpoints.latest and start.resume_command:
        summary = replace(summary, resume_command=start.resume_command)
    return summary
