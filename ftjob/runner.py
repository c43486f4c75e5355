"""The generic runner (driver side): validated JobConfig -> storage, data, cluster, chaos ->
TorchTrainer.fit() -> summary.json.

Everything that can be checked without Ray is checked first (storage reachable, dataset
listable, batch sizes, resume target), so bad input fails in seconds. The cluster is whatever
``ray.*`` says: an embedded local Ray (``address="local"``), a simulated multi-node cluster, or
an existing cluster at ``ray.address``; whatever the runner starts, it stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import secrets
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.chaos import NODE_KINDS, node_chaos_targets
from ftjob.checkpoint import CheckpointStore
from ftjob.checkpointer import run_scratch_dir
from ftjob.cluster import check_resources, cluster, probe_cluster
from ftjob.compose import override_key
from ftjob.config import ConfigError, JobConfig, JobError, to_plain
from ftjob.data import EpochPlan
from ftjob.datasets import TRAIN, VAL, ImageDataset, build_dataset
from ftjob.lease import LeaseHeld, RunLease
from ftjob.loggers import LogFeed, build_loggers
from ftjob.resume import ResumeError, catalog_fingerprint, check_resume, check_run_name
from ftjob.storage import (
    RetryingFileSystem,
    StorageError,
    build_filesystem,
    preflight,
    to_pyarrow,
)
from ftjob.summary import (
    FitOutcome,
    build_summary,
    decide_status,
    format_summary,
    write_summary,
)

logger = logging.getLogger("ftjob")


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
    data: dict[str, Any]  # the train catalog's fingerprint, kept in every checkpoint
    lease: RunLease  # this driver's hold on the run
    notes: list[str]  # said before training: a lease taken over, allowed resume changes


def prepare(job: JobConfig, run_dir: str) -> Prepared:
    """All checks that need no training: the cluster answers, storage, resume target,
    dataset, batch sizes."""
    if job.ray.address is not None:
        probe_cluster(job.ray.address)
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
    store, url = CheckpointStore(probe_fs, run_path), fs.unstrip_protocol(run_path)
    check_run_name(job, store, url)
    dataset = build_dataset(job.dataset)
    catalogs = {split: dataset.catalog(split) for split in (TRAIN, VAL)}
    data = catalog_fingerprint(catalogs[TRAIN], dataset.num_classes)
    stated = check_resume(job, store, url, data)
    plan = EpochPlan(catalogs[TRAIN].num_rows, job.trainer.global_batch_size, job.trainer.seed)
    if job.trainer.num_workers > catalogs[VAL].num_rows:
        raise JobError(
            f"trainer.num_workers={job.trainer.num_workers}: more workers than validation samples"
        )
    lease = RunLease(probe_fs, run_path, job.checkpoint.lease_timeout)  # last: nothing fails after
    try:
        lease_note = lease.acquire(name)
    except LeaseHeld as exc:
        raise JobError(str(exc)) from None
    notes = ([lease_note] if lease_note else []) + [
        f"resume: {change} (changed since the checkpoint; allowed)" for change in stated
    ]
    return Prepared(name, fs, root, run_path, dataset, catalogs, plan, data, lease, notes)


def _fit_outcome(
    exc: BaseException | None, interrupted: bool, preempted: bool = False
) -> FitOutcome:
    """How fit() ended, as the plain data :func:`ftjob.summary.decide_status` decides on. Only
    worker-group failures spend the failure budget; Ray Train's controller failing is said as
    such."""
    if preempted or exc is None:
        return FitOutcome(interrupted=interrupted, preempted=preempted)
    from ray.train import ControllerError, PreemptionError, WorkerGroupError

    text = str(exc).strip().splitlines()
    root = next((line for line in reversed(text) if line.strip()), type(exc).__name__)[:400]
    if isinstance(exc, WorkerGroupError):
        return FitOutcome(root, budget_exhausted=True, interrupted=interrupted)
    if isinstance(exc, PreemptionError):
        return FitOutcome(root, preemption_budget_exhausted=True, interrupted=interrupted)
    if isinstance(exc, ControllerError):
        return FitOutcome(f"Ray Train's controller failed: {root}", interrupted=interrupted)
    return FitOutcome(f"{type(exc).__name__}: {root}", interrupted=interrupted)


def run(
    job: JobConfig,
    run_dir: str,
    echo: Callable[[str], None] | None = None,
    overrides: list[str] | None = None,
) -> RunResult:
    """Run ``job``; write summary.json in ``run_dir``. Never raises for a failed training run
    (status "failed" or "interrupted" in the result); raises JobError/StorageError/ConfigError
    for bad input. ``overrides`` (the command line's) make the printed command that resumes a
    run that did not succeed."""
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
    for note in prep.notes:
        echo(note)
    feed = LogFeed(build_loggers(job.logger, run_dir, prep.name))
    feed.params(to_plain(job))
    try:
        snapshot, fit = _train_on_cluster(job, prep, echo, feed)
    finally:  # checkpoint scratch of every attempt on this node, killed ones' included
        shutil.rmtree(run_scratch_dir(prep.name), ignore_errors=True)
        prep.lease.release()
    status, error = decide_status(
        snapshot, fit, job.failure.max_failures, job.failure.max_preemptions
    )
    summary = build_summary(
        snapshot,
        name=prep.name,
        status=status,
        error=error,
        wall_time_s=time.time() - started,
        config=to_plain(job),
        driver_storage=prep.fs.snapshot_stats(),
        run_started=started,
    )
    if status != "succeeded":
        _how_to_resume(summary, snapshot, prep, overrides or [], echo)
    path = write_summary(summary, run_dir)
    feed.finish(summary)
    for line in format_summary(summary).splitlines():
        echo(line)
    if "resume_command" in summary:
        echo(f"to continue from {summary['checkpoints']['latest']}: {summary['resume_command']}")
    echo(f"summary: {path}")
    return RunResult(prep.name, status, error, summary, path)


def _how_to_resume(
    summary: dict[str, Any],
    snapshot: dict[str, Any],
    prep: Prepared,
    overrides: list[str],
    echo: Callable[[str], None],
) -> None:
    """A run that did not succeed: the checkpoint it continues from, and the command."""
    restored = [(a["restored"] or {}).get("step", -1) for a in snapshot["attempts"]]
    store = CheckpointStore(prep.fs, prep.run_path)
    settle_latest(summary, store, echo, max(restored, default=-1))
    if summary["checkpoints"]["latest"]:
        summary["resume_command"] = resume_command(overrides, prep)


def settle_latest(
    summary: dict[str, Any],
    store: CheckpointStore,
    echo: Callable[[str], None],
    restored_step: int = -1,
) -> None:
    """The newest committed checkpoint in storage is what a resume restores, so a stopped
    run's summary names that one. Usually the ledger's latest; but workers outlive the
    driver's last look at the ledger by a moment (until Ray has shut them down), and an
    upload in flight then may still commit. And a resumed run that committed nothing new
    continues from the one it restored (``restored_step``)."""
    try:
        newest = max(store.committed_steps(), default=-1)
    except StorageError as exc:
        echo(f"warning: could not list the checkpoints after the stop ({exc})")
        return
    record = summary["checkpoints"]
    known = store.step_of(record["latest"]) if record["latest"] else None
    if newest < 0 or (known is not None and newest <= known):
        return
    record["latest"] = store.path_for(newest)
    if newest > max(restored_step, -1 if known is None else known):
        echo(f"checkpoint step {newest} was committed while the run stopped")
        record["committed"] += 1
        record["committed_while_stopping"] = newest


def resume_command(overrides: list[str], prep: Prepared) -> str:
    """The command that continues this run from its latest committed checkpoint."""
    replaced = {"name", "resume", "checkpoint.storage_path"}
    kept = [o for o in overrides if override_key(o) not in replaced]
    storage = prep.fs.unstrip_protocol(prep.storage_root)
    args = [*kept, f"name={prep.name}", "resume=true", f"checkpoint.storage_path={storage}"]
    return "python -m ftjob " + " ".join(shlex.quote(a) for a in args)


class _StopSignal:
    """SIGTERM to the driver (Kubernetes, SLURM, ``ray job stop``) is a preemption notice:
    forwarded to the workers through the ledger; the run stops once their just-in-time
    checkpoint is recorded, or after ``wait_s``."""

    def __init__(self, enabled: bool, wait_s: float = 60.0) -> None:
        self.received: float | None = None
        self.enabled, self.wait_s = enabled, wait_s
        # Only the main thread may handle signals (runner.run called from another thread:
        # SIGTERM keeps its default).
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.enabled:  # failure.preemption=false: stop as on Ctrl-C, with a summary
            raise KeyboardInterrupt
        if self.received is None:
            self.received = time.time()

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)

    def done(self, ledger: Any, echo: Callable[[str], None]) -> bool:
        """Called every poll: True when the run should stop now."""
        import ray

        if self.received is None:
            return False
        if not ray.get(ledger.stop_requested.remote()):
            echo("SIGTERM: a preemption notice; committing a checkpoint of the current step")
            ledger.request_stop.remote("SIGTERM", self.received)
        latest = ray.get(ledger.latest_preemption.remote()) or {}
        return "jit" in latest or time.time() - self.received > self.wait_s


def _train_on_cluster(
    job: JobConfig, prep: Prepared, echo: Callable[[str], None], feed: LogFeed
) -> tuple[dict[str, Any], FitOutcome]:
    """Start the cluster, the ledger and the chaos killer; fit() on a thread while the main
    thread prints progress and services the simulated cluster; stop everything it started.
    Returns the ledger's final snapshot and how fit() ended."""
    interrupted = preempted = False
    with cluster(job) as local:
        import ray

        check_resources(job)
        if job.chaos.enabled and job.chaos.kind in NODE_KINDS and not node_chaos_targets():
            echo(
                f"warning: chaos kind={job.chaos.kind}: every node of this cluster is the head or "
                "the driver's node, which chaos never takes away; each window will be skipped"
            )
        ledger, killer = _start_run_actors(job, prep)
        monitor = _Monitor(ledger, echo, local, prep.lease, feed)
        outcome: dict[str, Any] = {}
        fit_thread = threading.Thread(
            target=_fit, args=(job, prep, ledger, outcome), name="ftjob-fit", daemon=True
        )
        stop = _StopSignal(job.failure.preemption)
        fit_thread.start()
        try:
            while fit_thread.is_alive():
                fit_thread.join(timeout=1.0)
                monitor.tick()
                if stop.done(ledger, echo):
                    preempted = True
                    break
        except KeyboardInterrupt:
            interrupted = True
            echo("interrupted: stopping the run")
        finally:
            stop.restore()
            if killer is not None:
                try:
                    ray.get(killer.stop.remote(), timeout=15)
                except Exception as exc:
                    logger.debug("stopping the chaos killer: %s", exc)
            monitor.tick()
            snapshot = ray.get(ledger.snapshot.remote())
    return snapshot, _fit_outcome(outcome.get("error"), interrupted, preempted)


def _start_run_actors(job: JobConfig, prep: Prepared) -> tuple[Any, Any]:
    from ftjob.chaos import start_killer
    from ftjob.hang import WatchConfig
    from ftjob.ledger import start_ledger

    plan = {
        "num_samples": prep.plan.num_samples,
        "global_batch_size": prep.plan.global_batch_size,
        "samples_per_epoch": prep.plan.samples_per_epoch,
        "steps_per_epoch": prep.plan.steps_per_epoch,
        "seed": prep.plan.seed,
        "epochs": job.trainer.epochs,
        "num_workers": job.trainer.num_workers,  # the most (elastic: min_workers the fewest)
    }
    ledger = start_ledger(plan, list(job.chaos.fail_at_steps), WatchConfig.from_job(job))
    killer = None
    if job.chaos.enabled:
        killer = start_killer(job.chaos, ledger)
    return ledger, killer


def _torch_trainer() -> Any:
    """Ray Train's TorchTrainer without its dataset integration. ftjob streams its own data
    (``ftjob.data``), and the integration is not idle when no dataset is given: it starts a
    DatasetManager actor -- a new process -- with every attempt, on the controller's node
    (measured: 1.5 CPU-seconds while the new workers start, on a 2-core machine)."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks import DatasetsCallback

    class FtjobTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            return [
                c
                for c in super()._create_default_callbacks()
                if not isinstance(c, DatasetsCallback)
            ]

    return FtjobTorchTrainer


def _fit(job: JobConfig, prep: Prepared, ledger: Any, outcome: dict[str, Any]) -> None:
    """Runs TorchTrainer.fit() (on a thread: the main thread services the local cluster)."""
    import ray
    import ray.train

    from ftjob.drains import drain_relay
    from ftjob.ledger import failure_watch
    from ftjob.scaling import elastic_policy
    from ftjob.train_loop import WorkerSpec, train_loop

    t = job.trainer
    spec = WorkerSpec(
        job=job,
        dataset=prep.dataset,
        catalogs={split: ray.put(table) for split, table in prep.catalogs.items()},
        ledger=ledger,
        fs=prep.fs,
        run_path=prep.run_path,
        run_name=prep.name,
        data=prep.data,
    )
    # Ray Train's controller polls its workers this often: it bounds how late a failure is
    # noticed and how long a ray.train.report waits for the previous one to be taken.
    f = job.failure
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(f.health_check_interval)
    # Node drains reach the workers through the run ledger's process, not through a watcher
    # process Ray Train would start with every attempt (ftjob.drains).
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    trainer = _torch_trainer()(
        train_loop,
        train_loop_config=spec,  # type: ignore[arg-type]
        scaling_config=ray.train.ScalingConfig(
            num_workers=(t.min_workers, t.num_workers) if t.elastic else t.num_workers,
            elastic_resize_monitor_interval_s=t.resize_interval,
            use_gpu=t.use_gpu,
            resources_per_worker=dict(t.resources_per_worker),
            placement_strategy=t.placement or ("SPREAD" if job.ray.local_nodes > 1 else "PACK"),
        ),
        run_config=ray.train.RunConfig(
            name=prep.name,
            storage_path=prep.storage_root,
            storage_filesystem=to_pyarrow(prep.fs),
            failure_config=ray.train.FailureConfig(
                max_failures=f.max_failures,
                max_preemption_failures=f.max_preemptions,
                preemption_grace_s=f.preemption_grace_s,
                relax_collectives_on_preemption=f.relax_collectives_on_preemption,
            ),
            callbacks=[failure_watch(ledger), drain_relay(ledger, f.preemption_poll_interval)],
        ),
    )
    try:
        with elastic_policy(ledger) if t.elastic else contextlib.nullcontext():
            outcome["result"] = trainer.fit()
    except BaseException as exc:
        outcome["error"] = exc


class _Monitor:
    """Prints the ledger's progress lines, ends a hung (or, if so configured, straggling)
    worker the ledger found, and replaces killed nodes of a local cluster."""

    def __init__(
        self, ledger: Any, echo: Callable[[str], None], local: Any, lease: RunLease, feed: LogFeed
    ) -> None:
        self.ledger, self.echo, self.local, self.lease = ledger, echo, local, lease
        self.feed = feed
        self.cursor = 0
        self.started = time.time()

    def tick(self) -> None:
        import ray

        self.lease.renew()
        try:
            lines, self.cursor = ray.get(self.ledger.poll.remote(self.cursor), timeout=10)
        except Exception as exc:
            logger.debug("ledger poll failed: %s", exc)
            return
        for line in lines:
            elapsed = int(time.time() - self.started)
            self.echo(f"{elapsed // 60:02d}:{elapsed % 60:02d} {line}")
        if self.feed.loggers:
            self.feed.records(ray.get(self.ledger.log_feed.remote(self.feed.cursor), timeout=10))
            self.feed.events(lines, time.time())
        for action in ray.get(self.ledger.check_watch.remote(time.time()), timeout=10):
            self._end_stalled(action)
        if self.local is not None:
            kills = ray.get(self.ledger.snapshot_kills.remote())
            self.local.service(kills, time.time())

    def _end_stalled(self, action: dict[str, Any]) -> None:
        """Capture a hung worker's stack and kill it (Ray Train restarts the group)."""
        import ray

        from ftjob.stacks import end_stalled_worker

        try:
            result = end_stalled_worker(action)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # its node went meanwhile
            result = {"pid": action["pid"], "error": f"{type(exc).__name__}: {exc}"}
        if action["action"] == "hang":
            self.ledger.hang_handled.remote(action["time"], result)
