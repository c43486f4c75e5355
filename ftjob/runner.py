"""The generic runner (driver side): validated JobConfig -> storage, data, cluster, chaos ->
TorchTrainer.fit() -> summary.json.

Everything that can be checked without Ray is checked first (storage reachable, dataset
listable, batch sizes, resume target), so bad input fails in seconds. The cluster is whatever
``ray.*`` says: an embedded local Ray (``address="local"``), a simulated multi-node cluster, or
an existing cluster at ``ray.address``; whatever the runner starts, it stops.
"""

from __future__ import annotations

import logging
import math
import os
import posixpath
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ftjob.checkpoint import CheckpointStore
from ftjob.config import ConfigError, JobConfig, to_plain
from ftjob.data import EpochPlan
from ftjob.datasets import TRAIN, VAL, ImageDataset, build_dataset
from ftjob.report import build_summary, format_summary, write_summary
from ftjob.resume import ResumeError, check_resume
from ftjob.storage import RetryingFileSystem, StorageError, build_filesystem, preflight, to_pyarrow

logger = logging.getLogger("ftjob")


class JobError(RuntimeError):
    """The job cannot run as configured; the message says what to change."""


@dataclass
class RunResult:
    name: str
    status: str  # "succeeded" | "failed"
    error: str | None
    summary: dict[str, Any]
    summary_path: str

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


def unique_run_name() -> str:
    return f"ftjob-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass
class Prepared:
    """What the driver resolves before Ray starts."""

    name: str
    fs: RetryingFileSystem
    storage_root: str
    run_path: str
    dataset: ImageDataset
    catalogs: dict[str, Any]
    plan: EpochPlan


def prepare(job: JobConfig, run_dir: str) -> Prepared:
    """All checks that need no cluster: storage, resume target, dataset, batch sizes."""
    name = job.name or unique_run_name()
    url = job.checkpoint.storage_path or os.path.join(os.path.abspath(run_dir), "checkpoints")
    probe_fs, root = build_filesystem(url, job.checkpoint.storage_options, job.checkpoint.retry)
    preflight(probe_fs, root)
    fs, root = build_filesystem(
        url,
        job.checkpoint.storage_options,
        job.checkpoint.retry,
        job.chaos.storage,
        seed=job.chaos.seed,
    )
    run_path = posixpath.join(root.rstrip("/"), name)
    check_resume(job, CheckpointStore(probe_fs, run_path), fs.unstrip_protocol(run_path))
    dataset = build_dataset(job.dataset)
    catalogs = {split: dataset.catalog(split) for split in (TRAIN, VAL)}
    plan = EpochPlan(catalogs[TRAIN].num_rows, job.trainer.global_batch_size, job.trainer.seed)
    if job.trainer.num_workers > catalogs[VAL].num_rows:
        raise JobError(
            f"trainer.num_workers={job.trainer.num_workers}: more workers than validation samples"
        )
    return Prepared(name, fs, root, run_path, dataset, catalogs, plan)


# -- cluster --------------------------------------------------------------------------------


class _RayNoiseFilter:
    """A stdout wrapper that turns Ray's raylet-death reports (a header plus the dead raylet's
    last 20 log lines, printed straight to stdout by the driver) into one short line. The
    ledger already reports every kill and failure; the log dump stays in Ray's log files."""

    _DUMP_LINE = re.compile(r"^\s+(\[state-dump\]|\[\d{4}-\d\d-\d\d [^]]*\] \(raylet\))|^\s*$")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.buffer = ""
        self.in_dump = False

    def write(self, text: str) -> int:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if "Raylet is terminated" in line:
            self.in_dump = True
            self.stream.write(
                "[ftjob] ray: a raylet died (its node is gone); details in Ray's session logs\n"
            )
            return
        if self.in_dump and self._DUMP_LINE.match(line):
            return
        self.in_dump = False
        self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def _quiet_ray_console(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    original = sys.stdout
    sys.stdout = _RayNoiseFilter(original)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = original


def _use_token_if_available() -> None:
    """Connect with token authentication when this machine has a Ray token, as `ray start`
    does (Ray 2.60 enables token auth for clusters it starts; a driver joining one must send
    the token, and Ray only does that when RAY_AUTH_MODE=token)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


@contextmanager
def cluster(job: JobConfig) -> Iterator[Any]:
    """Connect to or start the cluster ``job.ray`` describes; yields the LocalCluster (or None).
    Stops only what it started."""
    r = job.ray
    if r.address is not None:
        _use_token_if_available()  # before Ray is imported: it reads RAY_AUTH_MODE once
    import ray

    from ftjob.chaos import LocalCluster

    common: dict[str, Any] = {
        "log_to_driver": r.log_to_driver,
        "logging_level": logging.WARNING if r.log_to_driver else logging.ERROR,
        "runtime_env": dict(r.runtime_env) or None,
    }
    local: LocalCluster | None = None
    with _quiet_ray_console(not r.log_to_driver):
        try:
            if r.address is not None:
                ray.init(address=r.address, **common)
            elif r.local_nodes > 1:
                local = LocalCluster(r.local_nodes, r.node_cpus, r.replace_delay)
                ray.init(address=local.address, **common)
            else:
                train_cpus = job.trainer.num_workers * job.trainer.worker_cpus
                # Training workers hold their CPUs for the whole run; data decoding needs its own.
                num_cpus = r.num_cpus or (os.cpu_count() or 1) + math.ceil(train_cpus)
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **common)
            yield local
        finally:
            ray.shutdown()
            if local is not None:
                local.shutdown()


def check_resources(job: JobConfig) -> None:
    """Refuse a job the cluster can never schedule, instead of waiting forever."""
    import ray

    total = ray.cluster_resources()
    t = job.trainer
    if t.use_gpu:
        need = t.num_workers * float(t.resources_per_worker.get("GPU", 1.0))
        if total.get("GPU", 0.0) < need:
            raise JobError(
                f"trainer.use_gpu=true needs {need:g} GPUs but the cluster has {total.get('GPU', 0.0):g}: "
                "set trainer.use_gpu=false to train on CPUs, or connect to a GPU cluster with ray.address"
            )
    need_cpu = t.num_workers * t.worker_cpus + t.decode_cpus
    if total.get("CPU", 0.0) < need_cpu:
        raise JobError(
            f"the cluster has {total.get('CPU', 0.0):g} CPUs; {t.num_workers} workers x {t.worker_cpus:g} "
            f"CPUs plus trainer.decode_cpus={t.decode_cpus:g} for data decoding need {need_cpu:g}: lower "
            "trainer.num_workers or trainer.resources_per_worker.CPU"
        )
    for key, amount in t.resources_per_worker.items():
        if key not in ("CPU", "GPU") and total.get(key, 0.0) < amount * t.num_workers:
            raise JobError(
                f"trainer.resources_per_worker.{key}={amount:g}: the cluster has {total.get(key, 0.0):g} {key}"
            )


class _FailureWatch:
    """Ray Train controller callback: tells the ledger when a worker failure is noticed."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger

    def _send_storage_stats(self, run_context: Any) -> None:
        # The controller's own storage requests (run state, Ray's checkpoint bookkeeping).
        fs = getattr(
            getattr(run_context.run_config.storage_filesystem, "handler", None), "fs", None
        )
        if hasattr(fs, "snapshot_stats"):
            self.ledger.storage_stats.remote("controller", fs.snapshot_stats().as_dict())

    def after_report(self, run_context: Any, metrics: Any, checkpoint: Any) -> None:
        self._send_storage_stats(run_context)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._send_storage_stats(run_context)
        errors = {
            int(
                rank
            ): f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            for rank, e in worker_exceptions.items()
        }
        self.ledger.failure_noticed.remote(time.time(), errors)


def _failure_watch(ledger: Any) -> Any:
    from ray.train import UserCallback

    cls = type("FailureWatch", (_FailureWatch, UserCallback), {})
    return cls(ledger)


def _describe_failure(exc: BaseException, job: JobConfig, failures: int) -> str:
    from ray.train import TrainingFailedError

    text = str(exc).strip().splitlines()
    root = next((line for line in reversed(text) if line.strip()), type(exc).__name__)[:400]
    if isinstance(exc, TrainingFailedError):
        return (
            f"training failed after {failures} failure(s), over the budget failure.max_failures="
            f"{job.failure.max_failures}: {root}"
        )
    return f"{type(exc).__name__}: {root}"


# -- the run --------------------------------------------------------------------------------


def run(job: JobConfig, run_dir: str, echo: Callable[[str], None] | None = None) -> RunResult:
    """Run ``job``; write summary.json in ``run_dir``. Never raises for a failed training run
    (status "failed" in the result); raises JobError/StorageError/ConfigError for bad input."""
    echo = echo or (lambda line: print(f"[ftjob] {line}", flush=True))
    started = time.time()
    os.makedirs(run_dir, exist_ok=True)
    try:
        prep = prepare(job, run_dir)
    except (StorageError, ConfigError, JobError, ResumeError):
        raise
    except (FileNotFoundError, ValueError, TypeError, PermissionError) as exc:
        raise JobError(str(exc)) from None
    echo(
        f"run {prep.name}: {prep.dataset.describe()} ({prep.catalogs[TRAIN].num_rows} train / "
        f"{prep.catalogs[VAL].num_rows} val), {job.trainer.num_workers} workers x batch {job.trainer.batch_size}, "
        f"{prep.plan.steps_per_epoch} steps/epoch x {job.trainer.epochs} epochs"
    )
    echo(f"checkpoints: {prep.fs.unstrip_protocol(prep.run_path)}")
    status, error = "failed", None
    snapshot: dict[str, Any] | None = None
    with cluster(job) as local:
        import ray

        check_resources(job)
        ledger, killer = _start_run_actors(job, prep)
        monitor = _Monitor(ledger, echo, local)
        outcome: dict[str, Any] = {}
        fit_thread = threading.Thread(
            target=_fit, args=(job, prep, ledger, outcome), name="ftjob-fit", daemon=True
        )
        fit_thread.start()
        try:
            while fit_thread.is_alive():
                fit_thread.join(timeout=1.0)
                monitor.tick()
        except KeyboardInterrupt:
            error = "interrupted (Ctrl-C)"
            echo("interrupted: stopping the run")
        finally:
            if killer is not None:
                try:
                    ray.get(killer.stop.remote(), timeout=15)
                except Exception as exc:
                    logger.debug("stopping the chaos killer: %s", exc)
            monitor.tick()
            snapshot = ray.get(ledger.snapshot.remote())
        if error is None:
            if "error" in outcome:
                failures = len(snapshot["failures"])
                error = _describe_failure(outcome["error"], job, failures)
            elif snapshot["fatal"]:
                error = snapshot["fatal"]
            elif snapshot["finished"] is None:
                error = "training ended before the last epoch"
            else:
                status = "succeeded"
    summary = build_summary(
        snapshot,
        name=prep.name,
        status=status,
        error=error,
        wall_time_s=time.time() - started,
        config=to_plain(job),
        driver_storage=prep.fs.snapshot_stats(),
    )
    path = write_summary(summary, run_dir)
    for line in format_summary(summary).splitlines():
        echo(line)
    echo(f"summary: {path}")
    return RunResult(prep.name, status, error, summary, path)


def _start_run_actors(job: JobConfig, prep: Prepared) -> tuple[Any, Any]:
    from ftjob.chaos import start_killer
    from ftjob.ledger import start_ledger

    plan = {
        "num_samples": prep.plan.num_samples,
        "global_batch_size": prep.plan.global_batch_size,
        "samples_per_epoch": prep.plan.samples_per_epoch,
        "steps_per_epoch": prep.plan.steps_per_epoch,
        "seed": prep.plan.seed,
        "epochs": job.trainer.epochs,
    }
    ledger = start_ledger(plan, list(job.chaos.fail_at_steps))
    killer = None
    if job.chaos.kind != "none" and job.chaos.max_kills > 0:
        killer = start_killer(job.chaos, ledger)
    return ledger, killer


def _fit(job: JobConfig, prep: Prepared, ledger: Any, outcome: dict[str, Any]) -> None:
    """Runs TorchTrainer.fit() (on a thread: the main thread services the local cluster)."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from ftjob.train_loop import WorkerSpec, train_loop

    t = job.trainer
    spec = WorkerSpec(
        job=job,
        dataset=prep.dataset,
        catalogs={split: ray.put(table) for split, table in prep.catalogs.items()},
        ledger=ledger,
        run_path=prep.run_path,
    )
    # Ray Train's controller polls its workers this often: it bounds how late a failure is
    # noticed and how long a ray.train.report waits for the previous one to be taken.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(job.failure.health_check_interval)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=spec,  # type: ignore[arg-type]
        scaling_config=ray.train.ScalingConfig(
            num_workers=t.num_workers,
            use_gpu=t.use_gpu,
            resources_per_worker=dict(t.resources_per_worker),
            placement_strategy="SPREAD" if job.ray.local_nodes > 1 else "PACK",
        ),
        run_config=ray.train.RunConfig(
            name=prep.name,
            storage_path=prep.storage_root,
            storage_filesystem=to_pyarrow(prep.fs),
            failure_config=ray.train.FailureConfig(max_failures=job.failure.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.num_to_keep),
            callbacks=[_failure_watch(ledger)],
        ),
    )
    try:
        outcome["result"] = trainer.fit()
    except BaseException as exc:
        outcome["error"] = exc


class _Monitor:
    """Prints the ledger's progress lines and replaces killed nodes of a local cluster."""

    def __init__(self, ledger: Any, echo: Callable[[str], None], local: Any) -> None:
        self.ledger, self.echo, self.local = ledger, echo, local
        self.cursor = 0
        self.started = time.time()

    def tick(self) -> None:
        import ray

        try:
            lines, self.cursor = ray.get(self.ledger.poll.remote(self.cursor), timeout=10)
        except Exception as exc:
            logger.debug("ledger poll failed: %s", exc)
            return
        for line in lines:
            elapsed = int(time.time() - self.started)
            self.echo(f"{elapsed // 60:02d}:{elapsed % 60:02d} {line}")
        if self.local is not None:
            kills = ray.get(self.ledger.snapshot_kills.remote())
            self.local.service(kills, time.time())


def write_failed_summary(run_dir: str, error: str, config: Any) -> str:
    """summary.json for a job that could not start (so a sweep still reports it)."""
    from omegaconf import OmegaConf

    from ftjob.ledger import RunLedger

    plain = (
        OmegaConf.to_container(config, resolve=False) if not isinstance(config, dict) else config
    )
    summary = build_summary(
        RunLedger({}).snapshot(),
        name="",
        status="failed",
        error=error,
        wall_time_s=0.0,
        config=plain,
    )
    return write_summary(summary, run_dir)
