"""Sweep jobs side by side, and resumable sweeps: a Hydra launcher (``hydra/launcher=ftjob``).

Each sweep job is a full ``python -m ftjob`` run in its own process, with its own run dir
(``hydra.sweep.dir``/N, as Hydra's own launcher names them), run name and checkpoints; up to
``hydra.launcher.max_concurrent`` run at once. On an embedded or simulated cluster each job
starts its own Ray; with ``ray.address`` every job joins that cluster, which schedules them
all. A job's console goes to ``console.log`` in its dir; the sweep prints a line as each job
starts and ends, and the usual report at the end.

``hydra.launcher.resume=true`` (Hydra's own sweeps cannot resume) re-runs the same sweep
command over the same ``hydra.sweep.dir``: a job that succeeded is kept as it is (never run or
overwritten again), a job that left a checkpoint continues from it (``resume=true`` under its
run name), and the rest run from the start. The report is then rebuilt over all of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from fsspec.implementations.local import LocalFileSystem
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from ftjob.config.names import RUN_NAME
from ftjob.config.secrets import Redactor, redact_yaml, redactor_for
from ftjob.driver.ledger import empty_snapshot
from ftjob.reporting.run_summary import RunSummary
from ftjob.reporting.summary import SUMMARY_FILE, read_summary, write_failed_summary
from ftjob.reporting.sweep import MULTIRUN_FILE
from ftjob.storage.catalog import CheckpointCatalog


def previous_run(job_dir: str) -> tuple[str, str | None]:
    """What an earlier sweep left in ``job_dir``: ("succeeded", name), ("resume", name) when
    it has a committed checkpoint under the default storage or a summary naming one, else
    ("fresh", None)."""
    path = os.path.join(job_dir, SUMMARY_FILE)
    summary = read_summary(path) if os.path.exists(path) else RunSummary()
    if summary.ok:
        return "succeeded", summary.name or None
    if summary.name and summary.checkpoints.latest:
        return "resume", summary.name
    names = committed_runs(os.path.join(job_dir, "checkpoints"))
    if len(names) == 1:
        return "resume", names.pop()
    return "fresh", None


def committed_runs(storage: str) -> set[str]:
    """The runs in local storage directory ``storage`` that have a committed checkpoint --
    asked as everywhere else (``CheckpointCatalog.committed_steps``), never by a manifest's
    file name. Where a job killed before it wrote a summary is found: its default storage
    holds ``<name>/checkpoints/``."""
    try:
        names = os.listdir(storage)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    fs = LocalFileSystem()
    return {
        name
        for name in names
        if RUN_NAME.fullmatch(name)
        and os.path.isdir(os.path.join(storage, name))
        and CheckpointCatalog(fs, os.path.join(storage, name)).committed_steps()
    }


class SweepLauncher(Launcher):
    def __init__(self, max_concurrent: int = 2, resume: bool = False) -> None:
        super().__init__()
        if max_concurrent < 1:
            raise ValueError(f"hydra.launcher.max_concurrent={max_concurrent}: must be >= 1")
        self.max_concurrent, self.resume = max_concurrent, resume
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.redactor = Redactor()

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context = config, hydra_context

    def _job_config(self, overrides: Sequence[str]) -> DictConfig:
        assert self.hydra_context is not None and self.config is not None
        return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

    def _job_dir(self, overrides: Sequence[str], idx: int) -> str:
        assert self.config is not None
        sweep_config = self._job_config(overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
        return os.path.join(str(self.config.hydra.sweep.dir), str(sweep_config.hydra.sweep.subdir))

    def _command(self, overrides: Sequence[str], job_dir: str) -> tuple[list[str], str]:
        """The job's command line, and what it does (run, resume)."""
        args = [sys.executable, "-m", "ftjob", *overrides, "hydra.mode=RUN"]
        args.append(f"hydra.run.dir={job_dir}")
        if not self.resume:
            return args, "run"
        state, name = previous_run(job_dir)
        if state == "resume":
            return [*args, "resume=true", f"name={name}"], f"resume {name}"
        return args, "run"

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None
        os.makedirs(str(self.config.hydra.sweep.dir), exist_ok=True)
        job = self.config.copy()
        with open_dict(job):
            del job["hydra"]
        self.redactor = redactor_for(job)
        record = os.path.join(str(self.config.hydra.sweep.dir), MULTIRUN_FILE)
        if os.path.isfile(record):  # Hydra's record of the sweep command: no secrets in it
            redact_yaml(record, self.redactor)
        queue = list(enumerate(job_overrides, start=initial_job_idx))
        running: dict[int, _Running] = {}
        returns: dict[int, JobReturn] = {}
        try:
            self._run(queue, running, returns, job_overrides, initial_job_idx)
        except KeyboardInterrupt:  # Ctrl-C reached the jobs too: let them write their record
            print("[sweep] interrupted: waiting for the running jobs to stop", flush=True)
            for still in running.values():
                try:
                    still.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    still.proc.kill()
                still.console.close()
            raise
        return [returns[i] for i in sorted(returns)]

    def _run(
        self,
        queue: list[tuple[int, Sequence[str]]],
        running: dict[int, _Running],
        returns: dict[int, JobReturn],
        job_overrides: Sequence[Sequence[str]],
        initial_job_idx: int,
    ) -> None:
        from ftjob.cli.app import note_failed_job

        while queue or running:
            while queue and len(running) < self.max_concurrent:
                idx, overrides = queue.pop(0)
                job_dir = self._job_dir(overrides, idx)
                shown = " ".join(self.redactor.overrides(filter_overrides(overrides)))
                if self.resume and previous_run(job_dir)[0] == "succeeded":
                    print(f"[sweep] job {idx}: succeeded before, kept ({shown})", flush=True)
                    returns[idx] = _job_return(overrides, job_dir, 0)
                    continue
                args, what = self._command(overrides, job_dir)
                os.makedirs(job_dir, exist_ok=True)
                console = open(os.path.join(job_dir, "console.log"), "ab")
                launched, console_at = time.time(), console.tell()
                proc = subprocess.Popen(args, stdout=console, stderr=subprocess.STDOUT)
                running[idx] = _Running(
                    proc, job_dir, time.monotonic(), console, launched, console_at
                )
                print(f"[sweep] job {idx} ({shown}): {what} in {job_dir}", flush=True)
            time.sleep(0.5)
            for idx, job in list(running.items()):
                if job.proc.poll() is None:
                    continue
                job.console.close()
                del running[idx]
                code = job.proc.returncode
                took = time.monotonic() - job.started
                outcome = "succeeded" if code == 0 else f"did not succeed (exit {code})"
                print(f"[sweep] job {idx}: {outcome} in {took:.0f} s", flush=True)
                overrides = job_overrides[idx - initial_job_idx]
                if code != 0:
                    note_failed_job(job.job_dir)
                    try:
                        self._record_failure(job, overrides, code)
                    except (OSError, HydraException, OmegaConfBaseException) as exc:
                        # the disk, or the job's config not composing: the sweep goes on
                        print(f"[sweep] job {idx}: no failure record ({exc})", flush=True)
                returns[idx] = _job_return(overrides, job.job_dir, code)

    def _record_failure(self, job: _Running, overrides: Sequence[str], code: int) -> None:
        """A job that ended without writing a summary.json -- its input refused before it
        started (a single run writes none then), or killed outright -- gets a failed one with
        the error its console ended with, so the sweep's report says failed and why. A summary
        from before this launch (an earlier sweep's, in the same dir) is not this job's."""
        summary = os.path.join(job.job_dir, SUMMARY_FILE)
        if os.path.exists(summary) and os.path.getmtime(summary) >= job.launched:
            return
        from ftjob.cli.app import ERROR_PREFIX

        error = f"exited with code {code} before writing a summary"
        with open(os.path.join(job.job_dir, "console.log"), "rb") as f:
            f.seek(job.console_at)  # this launch's lines only
            said = [
                line
                for line in f.read().decode(errors="replace").splitlines()
                if line.startswith(ERROR_PREFIX)
            ]
        if said:
            error = said[-1][len(ERROR_PREFIX) :].strip()  # the job redacted it
        config = self._job_config(overrides)
        with open_dict(config):
            del config["hydra"]
        write_failed_summary(job.job_dir, error, config, empty_snapshot(), self.redactor)


class _Running(NamedTuple):
    """A sweep job in its own process: since when (monotonic; wall clock) and where its
    console stood at launch."""

    proc: subprocess.Popen[bytes]
    job_dir: str
    started: float
    console: Any
    launched: float
    console_at: int


def _job_return(overrides: Sequence[str], job_dir: str, code: int) -> JobReturn:
    ret = JobReturn(overrides=list(overrides), working_dir=job_dir)
    ret.status = JobStatus.COMPLETED
    ret.return_value = "succeeded" if code == 0 else "failed"
    return ret
