"""The run's record on the driver's side: pulled from a real ledger as the run goes (the audit
sent once), written to the run dir, read back whole after a kill mid-write, and what
``python -m ftjob.report`` rebuilds from it; the monitor's pulls, and its record when the
ledger is gone."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from ftjob.cli.report import main as report
from ftjob.driver.held_record import PULL_EVERY_S, HeldRecord
from ftjob.driver.ledger import RunLedger, empty_snapshot
from ftjob.driver.monitor import Monitor
from ftjob.record import CheckpointRecord, Progress, merged_audit
from ftjob.reporting import run_record
from ftjob.reporting.loggers import LogFeed
from ftjob.reporting.run_record import (
    RECORD_FILE,
    RecordFile,
    RecordStart,
    read_record,
    rebuilt_summary,
)
from tests.support.ledgers import make_ledger, restored, train


def _start(tmp_path: Path) -> RecordStart:
    return RecordStart("r", 100.0, {"trainer": {"epochs": 1}}, "python -m ftjob name=r resume=true")


def _progress(ledger: RunLedger, step: int) -> None:
    p = Progress(step, 0, 1, 5, 0.5, 100.0, 0.001, time.time())
    ledger.progress_update(0, p, {"train/steps_completed": float(step)})


def _pull(ledger: RunLedger, held: HeldRecord, now: float) -> None:
    held.take(ledger.pull(held.cursor), now)


def test_each_pull_sends_the_audit_once_and_the_held_record_is_the_ledgers(tmp_path):
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    held = HeldRecord(empty_snapshot(), RecordFile(str(tmp_path), _start(tmp_path)))
    train(ledger, 0, range(1, 3))
    ledger.audit_step(0, 2, 0, [99], [99])  # a second rank's slice of step 2
    first = ledger.pull(0)
    assert len(first.audit) == 3 and first.snapshot.audit == ()
    held.take(first, 1.0)
    train(ledger, 0, range(3, 5))
    second = ledger.pull(held.cursor)
    assert [a.step for a in second.audit] == [3, 4]  # only what came since
    held.take(second, 2.0)
    assert held.record() == ledger.snapshot()
    assert held.record().audit[1].ids[-1] == 99 and held.record().audit[1].skipped == (99,)
    assert merged_audit(first.audit + second.audit) == ledger.samples.audited()
    held.end("succeeded", 7.0)  # the driver wrote summary.json
    assert read_record(str(tmp_path)).end == run_record.RecordEnd("succeeded", 7.0)


def test_the_run_dirs_record_reads_back_as_held_a_torn_last_line_left_out(tmp_path):
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    ledger.restored(0, restored(2))
    held = HeldRecord(empty_snapshot(), RecordFile(str(tmp_path), _start(tmp_path)))
    train(ledger, 0, range(3, 5))
    _progress(ledger, 4)
    ledger.checkpoint(0, CheckpointRecord(4, "/ck/step_4", None, 0.1, time.time()))
    _pull(ledger, held, 5.0)
    _pull(ledger, held, 6.0)  # nothing changed: nothing written
    path = tmp_path / RECORD_FILE
    assert len(path.read_text().splitlines()) == 3  # start, audit, one snapshot
    with open(path, "a") as f:
        f.write('{"time":9.0,"snapshot":{"started":')  # killed mid-write
    kept = read_record(str(tmp_path))
    assert kept is not None and kept.end is None and kept.written == 5.0
    assert kept.snapshot == held.record() == ledger.snapshot()
    summary = rebuilt_summary(kept)
    assert summary.status == "failed" and "the driver did not end" in (summary.error or "")
    assert summary.checkpoints.latest == "/ck/step_4"
    assert summary.resume_command == "python -m ftjob name=r resume=true"
    assert summary.metrics["train/steps_completed"] == 4
    assert [a.epoch for a in summary.audit or ()] == [0]


def test_snapshots_a_newer_one_replaced_are_dropped_and_every_audit_slice_kept(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(run_record, "COMPACT_AFTER", 2000)
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    held = HeldRecord(empty_snapshot(), RecordFile(str(tmp_path), _start(tmp_path)))
    for step in range(1, 6):
        train(ledger, 0, range(step, step + 1))
        _progress(ledger, step)
        _pull(ledger, held, float(step))
    lines = (tmp_path / RECORD_FILE).read_text().splitlines()
    snapshots = [line for line in lines if '"snapshot"' in line]
    assert len(snapshots) < 5  # compacted at least once
    assert sum(1 for line in lines if line.startswith('{"audit"')) == 5
    assert read_record(str(tmp_path)).snapshot == ledger.snapshot()


def test_the_report_rebuilds_a_killed_drivers_summary_from_its_record(tmp_path, capsys):
    ledger = make_ledger()
    ledger.begin_attempt(time.time(), 1)
    held = HeldRecord(empty_snapshot(), RecordFile(str(tmp_path), _start(tmp_path)))
    train(ledger, 0, range(1, 4))
    _progress(ledger, 3)
    ledger.checkpoint(0, CheckpointRecord(2, "/ck/step_2", None, 0.1, time.time()))
    _pull(ledger, held, time.time())
    assert report([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"rebuilt from {tmp_path / RECORD_FILE}: the driver did not end" in out
    assert "run r: failed" in out and "steps 3 (" in out and "audit epoch 0: unique 24" in out
    assert "to continue from /ck/step_2: python -m ftjob name=r resume=true" in out
    assert not (tmp_path / "summary.json").exists()  # the report writes no summary


class _Ledger:
    """A real ledger behind Ray's calling convention; ``down``: it died (every call raises)."""

    def __init__(self, ledger: RunLedger) -> None:
        self.ledger, self.down, self.pulls = ledger, False, 0

    def __getattr__(self, name: str) -> Any:
        outer = self

        class Method:
            def remote(self, *args: Any) -> Any:
                if outer.down:
                    raise ray.exceptions.RayActorError()
                outer.pulls += name == "pull"
                return getattr(outer.ledger, name)(*args)

        return Method()


class _Keeper:
    lost: str | None = None


@pytest.fixture
def monitor_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)

    def make(ledger: RunLedger) -> tuple[Monitor, _Ledger, list[str]]:
        fake, said = _Ledger(ledger), []
        held = HeldRecord(empty_snapshot(), RecordFile(str(tmp_path), _start(tmp_path)))
        return Monitor(fake, said.append, None, _Keeper(), LogFeed([]), held=held), fake, said

    return make


def test_the_monitor_pulls_every_few_seconds_and_at_every_committed_checkpoint(monitor_of):
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    monitor, fake, _ = monitor_of(ledger)
    monitor.tick()
    monitor.tick()
    assert fake.pulls == 1  # the first tick pulls; the next is within PULL_EVERY_S
    ledger.checkpoint(0, CheckpointRecord(2, "/ck/step_2", None, 0.1, 2.0))
    monitor.tick()
    assert fake.pulls == 2 and monitor.held.record().committed()[0].step == 2
    monitor.held.pulled = time.time() - PULL_EVERY_S
    monitor.tick()
    assert fake.pulls == 3


def test_with_the_ledger_gone_the_run_ends_on_the_record_the_driver_holds(monitor_of):
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    monitor, fake, _ = monitor_of(ledger)
    train(ledger, 0, range(1, 4))
    ledger.checkpoint(0, CheckpointRecord(2, "/ck/step_2", None, 0.1, 2.0))
    monitor.tick()
    train(ledger, 0, range(4, 6))  # after the last pull: lost with the ledger
    fake.down = True
    snap = monitor.final_snapshot()
    assert "the run ledger died before the run ended (RayActorError" in (snap.fatal or "")
    assert "driver's copy (0 s old)" in (snap.fatal or "")
    assert [a.step for a in snap.audit] == [1, 2, 3] and snap.committed()[0].step == 2
    # Ray died, as the watch said: no ledger call, that reason.
    assert monitor.final_snapshot("Ray died under the run").fatal == "Ray died under the run"
    kept = read_record(str(monitor.held.file.path).rsplit("/", 1)[0])
    assert kept is not None and [a.step for a in kept.snapshot.audit] == [1, 2, 3]


def test_the_record_file_holds_no_secret_a_worker_error_carried(tmp_path):
    ledger = make_ledger()
    ledger.begin_attempt(1.0, 1)
    ledger.failure_noticed(2.0, {0: "OSError: token=hunter2 refused"})
    start = dataclasses.replace(_start(tmp_path), resume_command=None)
    held = HeldRecord(
        empty_snapshot(), RecordFile(str(tmp_path), start, lambda t: t.replace("hunter2", "***"))
    )
    _pull(ledger, held, 3.0)
    text = (tmp_path / RECORD_FILE).read_text()
    assert "hunter2" not in text and "token=***" in text
    assert json.loads(text.splitlines()[-1])["snapshot"]["failures"][0]["errors"]["0"]
    assert os.path.getsize(tmp_path / RECORD_FILE) > 0
