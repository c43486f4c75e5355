"""The Hydra application: compose -> validate -> runner.run, once per job (or per sweep job)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ftjob.config import ConfigError, JobConfig, JobError, load_job
from ftjob.config.secrets import Redactor, guard_logging, redact_hydra_files, redactor_for
from ftjob.driver.ledger import empty_snapshot
from ftjob.driver.resume import ResumeError
from ftjob.record import RunStatus
from ftjob.reporting.outputs import (
    TRACEBACK_FILE,
    append_console,
    close_open_mirror,
    finished_run_outputs,
    log_to_console_log,
)
from ftjob.reporting.summary import SUMMARY_FILE, read_summary, write_failed_summary
from ftjob.reporting.sweep import redact_sweep_record
from ftjob.storage.fs import StorageError

if TYPE_CHECKING:
    from ftjob.driver.runner import RunResult

_failed_jobs: list[str] = []
# A run that did not succeed: failed 1, interrupted (Ctrl-C) 130, preempted (SIGTERM) 143.
ERROR_PREFIX = "ftjob: error: "  # the line a run that stops on an error ends with
EXIT_CODES = {RunStatus.failed: 1, RunStatus.interrupted: 130, RunStatus.preempted: 143}


@dataclass(frozen=True)
class Ending:
    """How the command line ends a job that raised instead of returning a result: the status
    its summary.json records, the exit code of a single run, and whether the error is the
    user's to fix -- its one line, exit 2, no summary -- rather than a bug (summary.json and
    the traceback in the run dir, exit 1). A sweep job is recorded and the sweep goes on."""

    status: RunStatus
    exit_code: int
    bad_input: bool = False


# A job that raised ends by the first row naming its exception's type.
ENDINGS: tuple[tuple[tuple[type[BaseException], ...], Ending], ...] = (
    ((KeyboardInterrupt,), Ending(RunStatus.interrupted, 130)),
    ((ConfigError, JobError, StorageError, ResumeError), Ending(RunStatus.failed, 2, True)),
    ((Exception,), Ending(RunStatus.failed, 1)),
)


def ending_of(exc: BaseException) -> Ending | None:
    """The row of :data:`ENDINGS` that ends ``exc``; None: no job's to end (``SystemExit``,
    a generator's exit), it goes on up."""
    return next((ending for types, ending in ENDINGS if isinstance(exc, types)), None)


@hydra.main(version_base="1.3", config_path="pkg://ftjob.conf", config_name="config")
def _job(cfg: DictConfig) -> str:
    from ftjob.driver import runner

    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    multirun = hc.mode == RunMode.MULTIRUN
    logging.getLogger("ray").setLevel(logging.ERROR)
    redactor = _keep_secrets(cfg, run_dir, multirun)
    log_to_console_log(run_dir)
    try:
        job = load_job(cfg)
        overrides = list(hc.overrides.task)
        result = runner.run(job, run_dir, overrides=overrides, redactor=redactor)
    except BaseException as exc:
        ending = ending_of(exc)
        if ending is None:
            raise
        return end_job(exc, ending, cfg, run_dir, redactor, multirun)
    after_run(job, result, run_dir, redactor)
    if not result.ok:
        _failed_jobs.append(run_dir)
        if not multirun:
            sys.exit(EXIT_CODES.get(result.status, 1))
    return result.status


def end_job(
    exc: BaseException,
    ending: Ending,
    cfg: object,
    run_dir: str,
    redactor: Redactor,
    multirun: bool = False,
) -> str:
    """A job that raised ``exc``, ended as ``ending`` says: a single run exits (this returns
    only for a sweep job, recorded as failed: the sweep's word for it)."""
    if ending.status == RunStatus.interrupted:
        _stop_on_ctrl_c(cfg, run_dir, redactor, ending.exit_code)
    if multirun:
        return _record_failed_sweep_job(exc, ending.bad_input, cfg, run_dir, redactor)
    _stop_on_error(exc, ending, cfg, run_dir, redactor)


def _stop_on_ctrl_c(cfg: object, run_dir: str, redactor: Redactor, code: int) -> NoReturn:
    """Ctrl-C that reached the Hydra task, not the runner (which keeps its own record of
    later ones): before the run started, or after it wrote its record."""
    written = os.path.join(run_dir, SUMMARY_FILE)
    if os.path.exists(written):
        # Ctrl-C after the run wrote its record (drawing its timeline, closing loggers): the
        # record stands, and so does its exit code (a scheduler must not requeue a run that
        # succeeded).
        status = read_summary(written).status
        print(f"ftjob: Ctrl-C after the run ended ({status}); its summary stands", file=sys.stderr)
        _close_mirror(run_dir, None)
        sys.exit(EXIT_CODES.get(status, 0))
    error = "interrupted (Ctrl-C) during start-up (reading the config), before the first step"
    interrupted = RunStatus.interrupted
    write_failed_summary(run_dir, error, cfg, empty_snapshot(), redactor, interrupted)
    print(f"ftjob: {error}", file=sys.stderr)
    sys.exit(code)


def _stop_on_error(
    exc: BaseException, ending: Ending, cfg: object, run_dir: str, redactor: Redactor
) -> NoReturn:
    """A single run that could not run: bad input exits with its one line; a bug leaves its
    record (summary.json with the error) and its traceback in the run dir, one line on the
    console, and exits."""
    if ending.bad_input:
        line = f"{ERROR_PREFIX}{redactor.text(str(exc))}"
        print(line, file=sys.stderr)
        _close_mirror(run_dir, line)  # refused after its copy started (a logger's run id)
        sys.exit(ending.exit_code)
    trace = os.path.join(run_dir, TRACEBACK_FILE)
    text = redactor.text(traceback.format_exc())
    with open(trace, "w") as f:
        f.write(text)
    error = redactor.text(f"{type(exc).__name__}: {exc}")
    write_failed_summary(run_dir, error, cfg, empty_snapshot(), redactor)
    line = f"{ERROR_PREFIX}{error} (unexpected: traceback in {trace})"
    print(line, file=sys.stderr)
    _close_mirror(run_dir, f"{line}\n{text.rstrip()}")
    sys.exit(ending.exit_code)


def after_run(job: JobConfig, result: RunResult, run_dir: str, redactor: Redactor) -> None:
    """What the runner leaves to the command line once a run returned: ``resume=auto`` found
    the run finished, so its outputs in storage are kept or completed."""
    if result.summary.already_finished and job.checkpoint.storage_path:
        _copy_finished_run(job, result.name, run_dir, redactor)


def _copy_finished_run(job: JobConfig, name: str, run_dir: str, redactor: Redactor) -> None:
    """``resume=auto`` found the run finished: its outputs in storage, kept or completed."""

    def say(line: str) -> None:
        line = redactor.text(line)
        print(f"[ftjob] {line}", flush=True)
        append_console(run_dir, line)

    storage = job.checkpoint
    assert storage.storage_path is not None
    finished_run_outputs(
        storage.storage_path,
        storage.storage_options,
        storage.retry,
        name,
        run_dir,
        redactor,
        say,
        storage.lease_timeout,
    )


def _close_mirror(run_dir: str, last_line: str | None) -> None:
    """The run's copy in its storage, when the runner started one and could not close it: its
    console log ends as the console did, with the traceback of an unexpected error."""
    said = close_open_mirror(run_dir, last_line)
    if said is not None:
        print(f"ftjob: {said}", file=sys.stderr)


def _record_failed_sweep_job(
    exc: BaseException, bad_input: bool, cfg: object, run_dir: str, redactor: Redactor
) -> str:
    """A sweep goes on (Hydra would skip the sweep report if a job raised): the job is
    recorded as failed and reported with the others."""
    if not bad_input:
        logging.getLogger("ftjob").exception("sweep job failed: %s", run_dir)
    error = redactor.text(f"{type(exc).__name__}: {exc}")
    write_failed_summary(run_dir, error, cfg, empty_snapshot(), redactor)
    _close_mirror(run_dir, None)  # the job's log (a *.log: copied) holds the traceback
    _failed_jobs.append(run_dir)
    return "failed"


def _keep_secrets(cfg: DictConfig, run_dir: str, multirun: bool) -> Redactor:
    """The job's secrets (its config's, Hydra's ``job.env_set``): out of every log record from
    now on, and out of the records Hydra wrote before the job started -- a sweep's
    ``multirun.yaml`` too, whichever launcher runs the jobs."""
    hc = HydraConfig.get()
    redactor = redactor_for(cfg, hc.job.env_set)
    guard_logging(redactor)
    redact_hydra_files(run_dir, hc.output_subdir, redactor)
    if multirun:
        redact_sweep_record(str(hc.sweep.dir), redactor)
    return redactor


def note_failed_job(run_dir: str) -> None:
    """A sweep job that did not succeed (run by ftjob's launcher in its own process)."""
    _failed_jobs.append(run_dir)


def run_hydra(argv: list[str]) -> int:
    sys.argv = [sys.argv[0] or "ftjob", *argv]
    _job()
    return 1 if _failed_jobs else 0
