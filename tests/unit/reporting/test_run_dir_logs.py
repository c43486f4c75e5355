"""What the run dir holds once, as the tools that walk it find it: with checkpoint storage
inside the run dir (the default) the outputs are not copied into the run dir itself, and the
run's log records go to its console log -- no empty Hydra job log beside it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from ftjob.config import RetryConfig
from ftjob.config.secrets import Redactor
from ftjob.reporting.outputs import (
    OUTPUTS_DIR,
    ConsoleLogRecords,
    OutputsMirror,
    close_open_mirror,
    log_to_console_log,
)
from ftjob.storage.fs import build_filesystem
from tests.support.processes import ray_temp_dir

RETRY = RetryConfig(max_attempts=2, initial_backoff=0.01)


def a_run_dir_with_loggers(run_dir: Path) -> None:
    """A TensorBoard run under logs/ (where logger=tensorboard writes it), a W&B offline run,
    a summary and the console log."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "logs" / "tensorboard" / "run"))
    writer.add_scalar("train/loss", 0.5, 10)
    writer.close()
    offline = run_dir / "wandb" / "offline-run-20261207_010203-abc123" / "files"
    offline.mkdir(parents=True)
    (offline / "config.yaml").write_text("a: 1\n")
    (run_dir / "summary.json").write_text('{"status": "succeeded"}')
    (run_dir / "console.log").write_text("run run: ...\n")


def test_storage_inside_the_run_dir_gets_no_copy_and_every_file_lies_there_once(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "outputs" / "2026-12-07" / "01-02-03"
    a_run_dir_with_loggers(run_dir)
    # The default storage: <run dir>/checkpoints; the run's outputs would go to <name>/outputs.
    fs, target = build_filesystem(str(run_dir / "checkpoints" / "run" / OUTPUTS_DIR), {}, RETRY)
    mirror = OutputsMirror(fs, target, str(run_dir), Redactor()).start()
    mirror.request()
    assert mirror.sync() == 0 and mirror.close() is None
    assert mirror.line() == (
        f"outputs: {run_dir} (checkpoint storage lies inside this run dir: nothing is copied)"
    )
    assert not (run_dir / "checkpoints").exists()
    # What `tensorboard --logdir RUN_DIR` and a glob for W&B's offline runs find: one of each.
    assert len(list(run_dir.rglob("events.out.tfevents.*"))) == 1
    assert len(list(run_dir.rglob("offline-run-*"))) == 1
    assert close_open_mirror(str(run_dir), "ftjob: error: a bug") is None  # none was left open


def test_storage_outside_the_run_dir_still_gets_its_copy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run_dir"
    a_run_dir_with_loggers(run_dir)
    fs, target = build_filesystem(str(tmp_path / "storage" / "run" / OUTPUTS_DIR), {}, RETRY)
    mirror = OutputsMirror(fs, target, str(run_dir), Redactor())
    assert mirror.sync() > 0 and mirror.line().endswith("loggers' files: a copy)")
    copied = tmp_path / "storage" / "run" / OUTPUTS_DIR
    assert len(list(copied.rglob("events.out.tfevents.*"))) == 1
    assert (copied / "console.log").read_text() == "run run: ...\n"


def test_log_records_go_to_the_console_log_once(tmp_path: Path, monkeypatch) -> None:
    first, second = tmp_path / "job0", tmp_path / "job1"  # two jobs of a sweep, in one process
    first.mkdir()
    second.mkdir()
    root = logging.getLogger()
    try:
        log_to_console_log(str(first))
        logging.getLogger("ftjob.storage.retry").warning("storage request retried")
        log_to_console_log(str(second))
        logging.getLogger("ftjob").warning("the second job's")
    finally:
        for handler in [h for h in root.handlers if isinstance(h, ConsoleLogRecords)]:
            root.removeHandler(handler)
    assert (
        (first / "console.log")
        .read_text()
        .endswith("[ftjob.storage.retry][WARNING] - storage request retried\n")
    )
    assert (second / "console.log").read_text().endswith("[ftjob][WARNING] - the second job's\n")
    # A sweep job of ftjob's launcher: its stdout is the console log, records are there already.
    with open(first / "console.log", "a") as console:
        monkeypatch.setattr(sys, "stdout", console)
        log_to_console_log(str(first))
    assert not [h for h in root.handlers if isinstance(h, ConsoleLogRecords)]


def test_a_run_dir_holds_no_empty_hydra_job_log(tmp_path: Path) -> None:
    # Refused after Hydra made the run dir (storage that cannot be written): the run dir has
    # its config and no <job>.log, which was always empty but for stray records.
    ray_env, ray_started = ray_temp_dir(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftjob",
            "checkpoint.storage_path=/proc/ftjob-test",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ray_env},
    )
    assert proc.returncode == 2, proc.stderr
    assert (run_dir / ".hydra" / "config.yaml").exists() and not ray_started.exists()
    assert not list(run_dir.glob("*.log")), os.listdir(run_dir)
