"""What the command line does with a run's copy in its storage when the runner could not: a
driver stopped by a bug (its traceback, in the copied console log too), and ``resume=auto`` of
a run that is already finished (the outputs its driver never copied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftjob.cli import app
from ftjob.cli.report import main as report
from ftjob.config import RetryConfig, to_plain
from ftjob.config.secrets import Redactor
from ftjob.driver import runner
from ftjob.reporting.outputs import finished_run_outputs
from tests.support.jobs import compose_job
from tests.unit.driver.test_resume import finished_digits_run


def test_a_driver_stopped_by_a_bug_copies_its_traceback_and_last_line_to_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = tmp_path / "storage"
    job = compose_job("+experiment=digits_ft", "name=crash", f"checkpoint.storage_path={storage}")

    def a_bug(*args: object) -> None:  # after the copy started, before Ray
        raise RuntimeError("a bug in the loggers")

    monkeypatch.setattr(runner, "logger_feed", a_bug)
    run_dir, redactor = tmp_path / "run", Redactor(resolved=to_plain(job))
    with pytest.raises(SystemExit) as stopped:
        try:  # what the Hydra task does around the runner
            runner.run(job, str(run_dir), echo=lambda line: None, redactor=redactor)
        except RuntimeError as exc:
            app._stop_on_error(exc, False, to_plain(job), str(run_dir), redactor)
    assert stopped.value.code == 1
    outputs = storage / "crash" / "outputs"
    assert f"ftjob: outputs: file://{outputs} (a copy, traceback included)" in (
        capsys.readouterr().err
    )
    console = (outputs / "console.log").read_text()
    assert console.startswith("run crash: ")  # the whole console, then how it ended
    ended = console[console.index("ftjob: error: RuntimeError: a bug in the loggers") :]
    assert "(unexpected: traceback in " in ended and "Traceback (most recent call last)" in ended
    assert "in a_bug" in (outputs / "traceback.txt").read_text()
    assert json.loads((outputs / "summary.json").read_text())["status"] == "failed"
    # Read back from the run's storage: the report points at the traceback copied with it.
    assert report([str(storage / "crash")]) == 0
    printed = capsys.readouterr().out
    local = printed.split("copied to ")[1].split()[0]
    assert f"traceback: {local}/traceback.txt" in printed and "failed" in printed


def test_resume_auto_of_a_finished_run_copies_its_outputs_only_where_none_say_it_succeeded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The driver that trained the last step died before its final copy: the rerun (a
    # scheduler's) finds the run finished, exits 0, and its outputs say so in storage.
    storage, outputs = tmp_path / "storage", tmp_path / "storage" / "done" / "outputs"
    rerun = finished_digits_run(tmp_path, "resume=auto")
    run_dir, redactor = tmp_path / "rerun", Redactor(resolved=to_plain(rerun))
    result = runner.run(rerun, str(run_dir), echo=lambda line: None, redactor=redactor)
    assert result.ok
    app.after_run(rerun, result, str(run_dir), redactor)  # what the Hydra task does next
    said = (
        f"outputs: file://{outputs} (a copy of this run dir: the finished run's driver left none)"
    )
    assert f"[ftjob] {said}" in capsys.readouterr().out
    summary = json.loads((outputs / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["already_finished"]["step"] == 44
    assert said in (outputs / "console.log").read_text()
    # A copy that says the run succeeded is the finishing driver's own record: kept as it is.
    (outputs / "summary.json").write_text(json.dumps({"status": "succeeded", "metrics": {"a": 1}}))
    lines: list[str] = []
    retry = RetryConfig(max_attempts=2)
    again = str(tmp_path / "again")
    finished_run_outputs(str(storage), {}, retry, "done", again, Redactor(), lines.append)
    assert lines == [
        f"outputs: file://{outputs} (the run's own, from the driver that finished it: kept)"
    ]
    assert json.loads((outputs / "summary.json").read_text())["metrics"] == {"a": 1}


def test_a_driver_that_learns_at_its_start_that_another_holds_the_run_fails_and_writes_nothing_final(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A memory-tier holder refused this driver's fence and its lease agreed (LeaseLost, from
    # within the cluster's start): the run fails with the lease's reason as a lost lease does
    # -- no bug (nothing raised, no traceback copied into the run's storage), no resume
    # command, the lease left to the driver that holds it.
    from ftjob.storage.lease import LeaseLost

    storage = tmp_path / "storage"
    job = compose_job("+experiment=digits_ft", "name=deposed", f"checkpoint.storage_path={storage}")
    reason = "run 'deposed': the lease is held by generation 3"

    def deposed(*args: object) -> None:
        raise LeaseLost(reason)

    monkeypatch.setattr(runner, "_train_on_cluster", deposed)
    result = runner.run(job, str(tmp_path / "run"), echo=lambda line: None)
    assert not result.ok and result.status == "failed" and result.error == reason
    written = json.loads(Path(result.summary_path).read_text())
    assert written["status"] == "failed" and "resume_command" not in written
    assert not (storage / "deposed" / "outputs" / "traceback.txt").exists()
    # Its lease is not released: another driver's, as far as this one knows.
    [generation] = (storage / "deposed" / "lease").iterdir()
    assert "released" not in json.loads(generation.read_text())
