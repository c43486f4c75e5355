"""What the command line does with a run's copy in its storage when the runner could not: a
driver stopped by a bug (its traceback, in the copied console log too), and ``resume=auto`` of
a run that is already finished (the outputs its driver never copied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftjob.cli import app
from ftjob.cli.report import main as report
from ftjob.config import ConfigError, JobError, RetryConfig, to_plain
from ftjob.config.secrets import Redactor
from ftjob.driver import runner
from ftjob.driver.resume import ResumeError
from ftjob.record import RunStatus
from ftjob.reporting.outputs import finished_run_outputs
from ftjob.storage.fs import StorageError
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
            app.end_job(exc, app.Ending(RunStatus.failed, 1), to_plain(job), str(run_dir), redactor)
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
    # A live driver trains the run on (more epochs): its outputs, not yet "succeeded", are
    # its own -- the rerun of the old command copies nothing over them.
    (outputs / "summary.json").write_text(json.dumps({"status": "running"}))
    from fsspec.implementations.local import LocalFileSystem

    from ftjob.storage.lease import RunLease

    live = RunLease(LocalFileSystem(), str(storage / "done"), 60.0, owner="elsewhere:1")
    live.acquire()
    lines.clear()
    finished_run_outputs(str(storage), {}, retry, "done", again, Redactor(), lines.append, 60.0)
    assert lines == [
        f"outputs: file://{outputs} left to elsewhere:1, the driver that holds run 'done' now "
        "(its lease renewed within checkpoint.lease_timeout=60 s); if that driver is gone, run "
        "this command again after that time to copy this run dir there"
    ]
    assert json.loads((outputs / "summary.json").read_text()) == {"status": "running"}
    # Storage that fails the lease's read: the outputs are left as they are, said, no error.
    from ftjob.storage import lease as lease_module

    def down(*args: object) -> list[int]:
        raise ConnectionError("storage down")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lease_module, "generations", down)
        lines.clear()
        finished_run_outputs(str(storage), {}, retry, "done", again, Redactor(), lines.append)
    assert lines == [
        f"outputs: file://{outputs} left as they are: the run's lease could not be read "
        "(storage down)"
    ]
    assert json.loads((outputs / "summary.json").read_text()) == {"status": "running"}
    live.release()  # given back: the next rerun completes the outputs again
    lines.clear()
    finished_run_outputs(str(storage), {}, retry, "done", again, Redactor(), lines.append, 60.0)
    assert "a copy of this run dir" in lines[0]


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


def test_a_job_that_raised_ends_by_the_first_row_of_the_table_naming_its_type():
    interrupted, bad_input, bug = (ending for _, ending in app.ENDINGS)
    assert app.ending_of(KeyboardInterrupt()) == interrupted
    assert (interrupted.status, interrupted.exit_code) == (RunStatus.interrupted, 130)
    for exc in (
        ConfigError("trainer.num_workers", 0, "must be >= 1"),
        JobError("the run is held by another driver"),
        StorageError("s3://bucket: access denied"),
        ResumeError("no run named x"),
    ):
        assert app.ending_of(exc) == bad_input
    assert (bad_input.status, bad_input.exit_code, bad_input.bad_input) == (
        RunStatus.failed,
        2,
        True,
    )
    assert app.ending_of(RuntimeError("a bug")) == bug == app.Ending(RunStatus.failed, 1)
    assert app.ending_of(SystemExit(0)) is None  # not a job's to end: it goes on up


def _ended(exc: BaseException, run_dir: Path, multirun: bool = False) -> object:
    ending = app.ending_of(exc)
    assert ending is not None
    try:
        raise exc  # ended as the Hydra task ends it: inside its except block
    except BaseException as raised:
        try:
            return app.end_job(raised, ending, {"name": "x"}, str(run_dir), Redactor(), multirun)
        except SystemExit as stopped:
            return stopped.code


def test_bad_input_exits_2_with_its_line_and_a_bug_1_with_its_record_and_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _ended(ConfigError("trainer.num_workers", 0, "must be >= 1"), tmp_path / "a") == 2
    assert capsys.readouterr().err.startswith("ftjob: error: trainer.num_workers=0")
    assert not (tmp_path / "a" / "summary.json").exists()  # nothing ran: the line says it all
    (tmp_path / "b").mkdir()
    assert _ended(RuntimeError("a bug"), tmp_path / "b") == 1
    assert "ftjob: error: RuntimeError: a bug (unexpected: traceback in" in capsys.readouterr().err
    assert "RuntimeError: a bug" in (tmp_path / "b" / "traceback.txt").read_text()
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", "RuntimeError: a bug")


def test_ctrl_c_before_the_run_exits_130_and_a_sweep_job_that_raised_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app, "_failed_jobs", [])
    (tmp_path / "c").mkdir()
    assert _ended(KeyboardInterrupt(), tmp_path / "c") == 130
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["status"] == "interrupted"
    (tmp_path / "d").mkdir()
    assert _ended(StorageError("s3://b: denied"), tmp_path / "d", multirun=True) == "failed"
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("failed", "StorageError: s3://b: denied")
    assert app._failed_jobs == [str(tmp_path / "d")]  # the sweep's exit code counts it
