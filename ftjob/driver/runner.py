"""The generic runner (driver side): validated JobConfig -> storage, data, cluster, chaos ->
TorchTrainer.fit() -> summary.json.

Everything that can be checked without Ray is checked first (storage reachable, dataset
listable, batch sizes, resume target), so bad input fails in seconds. The cluster is whatever
``ray.*`` says: an embedded local Ray (``address="local"``), a simulated multi-node cluster, or
an existing cluster at ``ray.address``; whatever the runner starts, it stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import posixpath
import secrets
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ftjob.actors import Actor, ask
from ftjob.chaos.killer import KillerActor, node_chaos_targets
from ftjob.config import RESUME_AUTO, ConfigError, JobConfig, JobError, to_plain
from ftjob.config.compose import override_key
from ftjob.config.secrets import Redactor
from ftjob.data.audit import audited_catalogs
from ftjob.data.datasets import TRAIN, VAL, ImageDataset, build_dataset, epoch_plan
from ftjob.data.order import EpochPlan
from ftjob.driver.cluster import (
    check_local_gpus,
    check_machine,
    check_resources,
    cluster,
    oversubscribed_note,
    probe_cluster,
)
from ftjob.driver.held_record import HeldRecord
from ftjob.driver.ledger import RunLedger, empty_snapshot
from ftjob.driver.monitor import Monitor, StoppedDuringStartUp, StopSignal
from ftjob.driver.ray_death import RayDeathWatch
from ftjob.driver.resume import (
    NothingLeftToTrain,
    ResumeError,
    catalog_fingerprint,
    check_resume,
    check_run_name,
    check_run_place,
    finished_line,
)
from ftjob.driver.started_catalog import remember_catalog, started_catalog
from ftjob.memory.lifecycle import held_snapshots
from ftjob.record import RunPlan, RunSnapshot, RunStatus
from ftjob.reporting.loggers import LogFeed, LoggerError, continued_loggers
from ftjob.reporting.outputs import OUTPUTS_DIR, OutputsMirror, tee_console
from ftjob.reporting.run_record import RecordFile, RecordStart
from ftjob.reporting.run_summary import AlreadyFinished, CheckpointsSection, RunSummary
from ftjob.reporting.summary import build_summary, format_summary, write_summary
from ftjob.reporting.timeline import draw_timeline
from ftjob.reporting.verdict import FitEnd, RunEnd, decide_status
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.errors import is_storage_error
from ftjob.storage.fs import (
    RetryingFileSystem,
    StorageError,
    build_filesystem,
    preflight,
    to_pyarrow,
)
from ftjob.storage.identity import RunIdentity, run_identity
from ftjob.storage.lease import LeaseHeld, LeaseKeeper, LeaseLost, RunLease
from ftjob.storage.wrapper import exclusive_create_guarantee
from ftjob.text import shorten
from ftjob.worker.scratch import run_scratch_dir, scratch_name

logger = logging.getLogger("ftjob")


@dataclass
class RunResult:
    name: str
    status: RunStatus
    error: str | None
    summary: RunSummary
    summary_path: str

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.succeeded


RAY_TRAIN_DIR = "ray_train"  # under the run's directory: Ray Train's own bookkeeping


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
    scratch: str  # this driver's checkpoint scratch on each node (checkpointer.scratch_name)
    public_config: dict[str, Any]  # the resolved config with its secrets redacted
    redactor: Redactor  # what keeps secrets out of what the run writes and prints
    # resume=auto on a run whose checkpoint is at its last step: the line that says so, and
    # that step; nothing is trained (and the lease was not taken: nothing is written).
    finished: str | None = None
    finished_step: int | None = None
    continues: bool = False  # the run goes on from a checkpoint (resume=true, or auto)
    identity: RunIdentity | None = None  # its name and storage, on a cluster (none: finished)

    @property
    def run(self) -> RunIdentity:
        """The run's identity on a cluster: what names everything ftjob starts there for it."""
        if self.identity is None:
            raise RuntimeError(f"run {self.name!r} is finished: it starts nothing on a cluster")
        return self.identity


def prepare(job: JobConfig, run_dir: str, redactor: Redactor | None = None) -> Prepared:
    """All checks that need no training: the cluster answers, storage, resume target,
    dataset, batch sizes; then the run's lease."""
    redactor = redactor or Redactor(resolved=to_plain(job))
    public = redactor.config(to_plain(job))
    if job.ray.address is not None:
        probe_cluster(job.ray.address)
    check_local_gpus(job)
    check_machine(job)  # a cluster ftjob starts here must hold the job: refused before Ray
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
    check_run_place(probe_fs, url, run_path, job.dataset.get("path"))
    store, url = CheckpointStore(probe_fs, run_path), fs.unstrip_protocol(run_path)
    resumption = check_run_name(job, store, url)  # resume=auto decides here: before Ray
    dataset = build_dataset(job.dataset)
    catalogs = audited_catalogs(dataset)  # a split of nothing, one class: refused here
    catalogs[TRAIN], removed = started_catalog(
        probe_fs, run_path, catalogs[TRAIN], resumption.continues, dataset.max_bad_fraction
    )
    data = catalog_fingerprint(catalogs[TRAIN], dataset.num_classes)
    stated, finished = _continue_checks(job, store, url, data, public, resumption.continues)
    plan = epoch_plan(dataset, catalogs[TRAIN], job.trainer)
    if job.trainer.num_workers > catalogs[VAL].num_rows:
        raise JobError(
            f"trainer.num_workers={job.trainer.num_workers}: more workers than validation samples"
        )
    notes = [resumption.said] if resumption.said and finished is None else []
    # Last: nothing fails after it. A finished run writes nothing: it takes no lease.
    lease, taken, identity = _take_run(job, name, probe_fs, run_path, catalogs[TRAIN], not finished)
    if job.resume == RESUME_AUTO and not resumption.continues:
        with _given_back_if_raised(lease):  # storage down
            committed = store.committed_steps()
        if committed:
            # The driver whose lease this one waited out committed meanwhile (its workers
            # outlive a frozen driver): "starting it" no longer holds. Give the lease up and
            # decide again -- now on the committed checkpoint, with every check a continued
            # run gets (that pass continues or refuses: it never comes back here).
            lease.release()
            return prepare(job, run_dir, redactor)
    notes += [*taken, *(f"resume: {line}" for line in stated + removed)]
    notes += [*dataset.catalog_notes(), *filter(None, [job.trainer.exact_note])]  # hidden files..
    return Prepared(
        name,
        fs,
        root,
        run_path,
        dataset,
        catalogs,
        plan,
        data,
        lease,
        notes,
        scratch_name(name),
        public,
        redactor,
        finished_line(job, url, finished) if finished else None,
        finished.step if finished else None,
        resumption.continues,
        identity,
    )


def _continue_checks(
    job: JobConfig,
    store: CheckpointStore,
    url: str,
    data: dict[str, Any],
    public: dict[str, Any],
    continues: bool,
) -> tuple[list[str], NothingLeftToTrain | None]:
    """A run that continues: what it states (:func:`check_resume`), or -- ``resume=auto`` on a
    checkpoint at the run's last step -- that it is finished."""
    if not continues:
        return [], None
    try:
        return check_resume(job, store, url, data, public), None
    except NothingLeftToTrain as done:
        if job.resume != RESUME_AUTO:
            raise
        return [], done


@contextlib.contextmanager
def _given_back_if_raised(lease: RunLease) -> Iterator[None]:
    """A driver that fails right after taking the run's lease (a full disk, storage down, a
    Ctrl-C) gives it back, not leaving it for the next driver to wait out; the error goes on."""
    try:
        yield
    except BaseException:
        lease.release()
        raise


def _take_run(
    job: JobConfig, name: str, fs: Any, run_path: str, train_catalog: Any, take: bool = True
) -> tuple[RunLease, list[str], RunIdentity | None]:
    """The run's lease, taken when ``take`` (refused while another driver holds it;
    ``resume=auto`` waits out a holder that has gone silent), and the train catalog the run
    started with kept at its first start; the notes to say; the run's identity on a cluster
    (read, or made at its first start: before the lease, so that nothing fails once it is
    taken), when ``take``."""
    lease = RunLease(
        fs,
        run_path,
        job.checkpoint.lease_timeout,
        run_name=name,
        wait_out=job.resume == RESUME_AUTO,  # a rerun right after its driver died elsewhere
    )
    if not take:
        return lease, [], None
    identity = run_identity(fs, run_path, name)
    try:
        lease_note = lease.acquire()
    except LeaseHeld as exc:
        raise JobError(str(exc)) from None
    with _given_back_if_raised(lease):
        remember_catalog(fs, run_path, train_catalog)  # at the run's first start
    notes = [f"run lease: one driver per run, by {exclusive_create_guarantee(fs)}"]
    return lease, notes + ([lease_note] if lease_note else []), identity


def fit_end(exc: BaseException | None, stopped: FitEnd | None = None) -> FitEnd:
    """The terminal state of the run's training: where the driver stopped it (``stopped``:
    Ctrl-C, a notice, Ray dying under it), else how fit() ended -- returned, or the error it
    raised. Only worker-group failures spend the failure budget; Ray Train's controller
    failing is said as such."""
    if stopped is not None:
        return stopped
    if exc is None:
        return FitEnd(RunEnd.FINISHED)
    from ray.train import ControllerError, PreemptionError, WorkerGroupError

    text = str(exc).strip().splitlines()
    root = shorten(next((line for line in reversed(text) if line.strip()), type(exc).__name__), 400)
    if isinstance(exc, WorkerGroupError):
        return FitEnd(RunEnd.FAILURES_EXHAUSTED, root)
    if isinstance(exc, PreemptionError):
        return FitEnd(RunEnd.PREEMPTIONS_EXHAUSTED, root)
    if isinstance(exc, ControllerError):
        return FitEnd(RunEnd.CONTROLLER_FAILED, f"Ray Train's controller failed: {root}")
    return FitEnd(RunEnd.ERRORED, f"{type(exc).__name__}: {root}")


def run(
    job: JobConfig,
    run_dir: str,
    echo: Callable[[str], None] | None = None,
    overrides: list[str] | None = None,
    redactor: Redactor | None = None,
) -> RunResult:
    """Run ``job``; write summary.json in ``run_dir`` -- also for a run stopped (Ctrl-C,
    SIGTERM) during start-up. Never raises for a run that did not succeed (status "failed",
    "interrupted" or "preempted" in the result); raises JobError/StorageError/ConfigError for
    bad input. ``overrides`` (the command line's) make the printed command that resumes a run
    that did not succeed; ``redactor`` keeps secrets out of everything written or printed."""
    redactor = redactor or Redactor(resolved=to_plain(job))
    started = time.time()
    os.makedirs(run_dir, exist_ok=True)
    say = tee_console(run_dir, echo or (lambda line: print(f"[ftjob] {line}", flush=True)))

    def tell(line: str) -> None:  # every line the run says: its secrets redacted, teed
        say(redactor.text(line))

    stop = StopSignal(job.failure.preemption)
    prep: Prepared | None = None
    trained = Trained(empty_snapshot(), FitEnd(), summary=SummaryFile(run_dir))
    try:
        try:
            prep = prepare(job, run_dir, redactor)
        except (StorageError, ConfigError, JobError, ResumeError):
            raise
        except (FileNotFoundError, ValueError, TypeError, PermissionError) as exc:
            raise JobError(redactor.text(str(exc))) from None
        if prep.finished is None:
            start = record_start(prep, started, overrides or [], redactor)
            ended = functools.partial(
                _ray_died, job, run_dir, prep, trained, started, overrides or [], tell, redactor
            )
            trained = _train(job, prep, run_dir, tell, stop, trained, start, ended)
    except (KeyboardInterrupt, StoppedDuringStartUp, SystemExit) as exc:
        # SystemExit(SIGTERM): Ray's own handler, while ray.init starts the cluster.
        if isinstance(exc, SystemExit) and exc.code != signal.SIGTERM:
            raise
        sigterm = not isinstance(exc, KeyboardInterrupt)
        trained.fit = FitEnd(
            RunEnd.PREEMPTED if sigterm else RunEnd.INTERRUPTED,
            stopped_at=f"during start-up ({stop.stage}), before the first step",
        )
    finally:
        stop.restore()
    return _finish(job, run_dir, prep, trained, started, overrides or [], tell, redactor)


class SummaryFile:
    """summary.json in the run dir: written at the driver's end, or before it by the thread
    that saw Ray die under the run (the driver may not outlive Ray by long); the end's
    stands."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir, self.ended = run_dir, False
        self._lock = threading.Lock()

    def early(self, summary: RunSummary) -> str | None:
        """Writes ``summary`` unless the end's is written already (then None)."""
        with self._lock:
            return None if self.ended else write_summary(summary, self.run_dir)

    def end(self, summary: RunSummary) -> str:
        with self._lock:
            self.ended = True
            return write_summary(summary, self.run_dir)


@dataclass
class Trained:
    """How the run went, as the driver saw it."""

    snapshot: RunSnapshot  # the run ledger's
    fit: FitEnd  # how its training ended
    feed: LogFeed | None = None
    lease_lost: str | None = None  # another driver holds the run now: why this one stopped
    outputs: OutputsMirror | None = None  # the run dir's copy in the run's storage
    held: HeldRecord | None = None  # the run's record on the driver's side, and in the run dir
    summary: SummaryFile | None = None


def record_start(
    prep: Prepared, started: float, overrides: list[str], redactor: Redactor
) -> RecordStart:
    """What the run's record in the run dir starts with: what ``python -m ftjob.report``
    needs besides the ledger's record to rebuild the summary of a driver that did not end."""
    command, _ = resume_command(overrides, prep, redactor)
    return RecordStart(prep.name, started, prep.public_config, command)


def _train(
    job: JobConfig,
    prep: Prepared,
    run_dir: str,
    echo: Callable[[str], None],
    stop: StopSignal,
    out: Trained,
    start: RecordStart,
    ray_died: Callable[[str], None] = lambda reason: None,
) -> Trained:
    """Loggers, lease keeper, the run's record in the run dir (``start``: what it starts
    with), cluster, fit; whatever it starts it stops (the scratch of every attempt on this
    node, killed ones' included, and the lease, when it is still ours). ``ray_died(reason)``:
    a Ray this driver started died under the run."""
    keeper = LeaseKeeper(prep.lease).start()
    try:
        out.held = HeldRecord(empty_snapshot(), RecordFile(run_dir, start, prep.redactor.text))
        echo(
            f"run {prep.name}: {prep.dataset.describe()} ({prep.catalogs[TRAIN].num_rows} train / "
            f"{prep.catalogs[VAL].num_rows} val), {job.trainer.num_workers} workers x batch "
            f"{job.trainer.batch_size}, {prep.plan.steps_per_epoch} steps/epoch x "
            f"{job.trainer.epochs} epochs{oversubscribed_note(job)}"
        )
        echo(f"checkpoints: {prep.fs.unstrip_protocol(prep.run_path)}")
        out.outputs = outputs_mirror(job, prep, run_dir)
        echo(out.outputs.line())  # where its copy is, or that the run dir is beside storage
        for note in prep.notes:
            echo(note)
        out.feed = logger_feed(job, prep, run_dir, echo)
        out.feed.params(prep.public_config)
        try:
            t0 = start.started  # the driver's start: the progress lines' clock, the timeline's
            out.snapshot, out.fit = _train_on_cluster(
                job, prep, echo, out.feed, keeper, stop, out.outputs, out.held, ray_died, t0
            )
        except LeaseLost as exc:  # a holder knew a newer driver, and the lease agreed
            out.lease_lost = str(exc)
    finally:
        keeper.stop()
        out.lease_lost = out.lease_lost or keeper.lost
        shutil.rmtree(run_scratch_dir(prep.scratch), ignore_errors=True)
        if out.lease_lost is None:
            prep.lease.release()
    return out


def lease_check(lease: RunLease) -> Callable[[], None]:
    """The lease's check as the memory tier's fence asks it (a holder refused this driver's
    generation): :class:`LeaseLost` where another driver holds the run, or where storage
    cannot say (this driver cannot show the run is its own: it stops)."""

    def check() -> None:
        try:
            lease.check()
        except LeaseLost:
            raise
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            raise LeaseLost(
                f"run {lease.run_name!r}: a snapshot holder knows a newer lease generation "
                f"than this driver's, and the lease could not be checked ({type(exc).__name__}: "
                f"{exc}): stopped before the workers start"
            ) from exc

    return check


def logger_feed(
    job: JobConfig, prep: Prepared, run_dir: str, echo: Callable[[str], None]
) -> LogFeed:
    """The experiment loggers; a run that continues carries on its W&B and MLflow runs."""
    storage = (prep.fs, prep.run_path)
    try:
        label = prep.identity.label if prep.identity is not None else None
        loggers = continued_loggers(
            job.logger, run_dir, prep.name, storage, prep.continues, echo, label
        )
    except LoggerError as exc:
        raise JobError(prep.redactor.text(str(exc))) from None
    return LogFeed(loggers, live=job.logger.live)


def _finish(
    job: JobConfig,
    run_dir: str,
    prep: Prepared | None,
    trained: Trained,
    started: float,
    overrides: list[str],
    echo: Callable[[str], None],
    redactor: Redactor,
) -> RunResult:
    """The verdict, summary.json, the loggers' end, the printed summary and resume command."""
    snapshot = trained.snapshot
    status, error = decide_status(
        snapshot, trained.fit, job.failure.max_failures, job.failure.max_preemptions
    )
    if trained.lease_lost:
        status, error = RunStatus.failed, trained.lease_lost
    if prep is not None and prep.finished is not None and not trained.fit.stopped_at:
        # resume=auto of a finished run: it succeeded before; a scheduler that reruns it gets
        # success (exit 0), not a failure to retry
        echo(prep.finished)
        status, error = RunStatus.succeeded, None
    ended = _Ending(job, prep, started, overrides, echo, redactor)
    summary = ended.summary(snapshot, status, error, resumable=not trained.lease_lost)
    if prep is not None and prep.finished_step is not None:
        path = CheckpointStore(prep.fs, prep.run_path).path_for(prep.finished_step)
        checkpoints = dataclasses.replace(summary.checkpoints, latest=path)
        done = AlreadyFinished(prep.finished_step, path)
        summary = dataclasses.replace(summary, checkpoints=checkpoints, already_finished=done)
    summary = scrubbed(summary, redactor)
    path = (trained.summary or SummaryFile(run_dir)).end(summary)
    if trained.held is not None:
        trained.held.end(status, time.time())
    ended.say(summary, path)
    picture = draw_timeline(summary, run_dir)
    if trained.feed is not None:
        trained.feed.finish(summary)
    echo(picture)
    if trained.outputs is not None:  # last: the console log holds every line above
        warning = trained.outputs.close(final=not trained.lease_lost)
        if warning:
            echo(warning)
    return RunResult(ended.name, status, error, summary, path)


@dataclass
class _Ending:
    """What a run's summary is made with, at its end or when Ray died under it."""

    job: JobConfig
    prep: Prepared | None
    started: float
    overrides: list[str]
    echo: Callable[[str], None]
    redactor: Redactor

    @property
    def name(self) -> str:
        return self.prep.name if self.prep else (self.job.name or "")

    def summary(
        self,
        snapshot: RunSnapshot,
        status: RunStatus,
        error: str | None,
        resumable: bool = True,
        settle: bool = True,
    ) -> RunSummary:
        """summary.json's content; a run that did not succeed names the checkpoint it
        continues from (``settle``: the newest in storage) and the command."""
        prep, redactor = self.prep, self.redactor
        summary = build_summary(
            snapshot,
            name=self.name,
            status=status,
            error=redactor.text(error) if error else error,
            wall_time_s=time.time() - self.started,
            config=prep.public_config if prep else redactor.config(to_plain(self.job)),
            driver_storage=prep.fs.snapshot_stats() if prep else None,
            run_started=self.started,
        )
        if status != RunStatus.succeeded and prep is not None and resumable:
            summary = _how_to_resume(
                summary, snapshot, prep, self.overrides, self.echo, redactor, settle
            )
        return summary

    def say(self, summary: RunSummary, path: str) -> None:
        for line in format_summary(summary).splitlines():
            self.echo(line)
        if summary.resume_command:  # before the slow parts: a stop's SIGKILL may come next
            latest = summary.checkpoints.latest
            self.echo(f"to continue from {latest}: {summary.resume_command}")
        self.echo(f"summary: {path}")


def scrubbed(summary: RunSummary, redactor: Redactor) -> RunSummary:
    """``summary`` as summary.json will hold it: every string scrubbed of the run's secrets
    (workers' error texts, paths), non-finite numbers null."""
    return RunSummary.from_json(redactor.strings(summary.document()))


def _ray_died(
    job: JobConfig,
    run_dir: str,
    prep: Prepared,
    trained: Trained,
    started: float,
    overrides: list[str],
    echo: Callable[[str], None],
    redactor: Redactor,
    reason: str,
) -> None:
    """Ray died under the run (on the thread that saw it): summary.json at once, from the
    record the driver holds -- this process may be ended by Ray's core worker within seconds
    --, then again with the newest checkpoint in storage. The driver's end, if it comes,
    writes it once more."""
    echo(reason)
    if trained.held is None or trained.summary is None:
        return
    snapshot = trained.held.record(reason)
    ended = _Ending(job, prep, started, overrides, echo, redactor)
    for settle in (False, True):
        summary = scrubbed(
            ended.summary(snapshot, RunStatus.failed, reason, settle=settle), redactor
        )
        path = trained.summary.early(summary)
        if path is None:
            return  # the driver's end wrote it
        if not settle:  # the whole summary is printed at the driver's end, if it comes
            echo(f"summary (the driver's record as Ray died): {path}")
    if summary.resume_command:
        echo(f"to continue from {summary.checkpoints.latest}: {summary.resume_command}")
    if trained.outputs is not None:
        trained.outputs.request()


def outputs_mirror(job: JobConfig, prep: Prepared, run_dir: str) -> OutputsMirror:
    """The run dir's copy in ``<run>/outputs/`` of the run's storage, started: through a
    retrying filesystem of its own (no injected storage faults; its requests are not the
    run's in summary.json), brought up to date now, at each committed checkpoint and at the
    end."""
    url = posixpath.join(prep.fs.unstrip_protocol(prep.run_path), OUTPUTS_DIR)
    fs, target = build_filesystem(url, job.checkpoint.storage_options, job.checkpoint.retry)
    fence = prep.lease.fence() if prep.lease.generation is not None else None
    mirror = OutputsMirror(fs, target, run_dir, prep.redactor, fence).start()
    mirror.request()
    return mirror


def _how_to_resume(
    summary: RunSummary,
    snapshot: RunSnapshot,
    prep: Prepared,
    overrides: list[str],
    echo: Callable[[str], None],
    redactor: Redactor,
    settle: bool = True,
) -> RunSummary:
    """A run that did not succeed: the checkpoint it continues from (``settle``: the newest
    in storage, else the newest the record holds), and the command."""
    restored = [r.step for r in snapshot.restores()]
    if settle:
        store = CheckpointStore(prep.fs, prep.run_path)
        latest = settle_latest(summary.checkpoints, store, echo, max(restored, default=-1))
        summary = dataclasses.replace(summary, checkpoints=latest)
    if summary.checkpoints.latest:
        command, notes = resume_command(overrides, prep, redactor)
        summary = dataclasses.replace(summary, resume_command=command)
        for note in notes:
            echo(f"resume: {note}")
    return summary


def settle_latest(
    record: CheckpointsSection,
    store: CheckpointStore,
    echo: Callable[[str], None],
    restored_step: int = -1,
) -> CheckpointsSection:
    """The newest committed checkpoint in storage is what a resume restores, so a stopped
    run's summary names that one. Usually the ledger's latest; but workers outlive the
    driver's last look at the ledger by a moment (until Ray has shut them down), and an
    upload in flight then may still commit. And a resumed run that committed nothing new
    continues from the one it restored (``restored_step``)."""
    try:
        newest = next(iter(store.committed_steps()), -1)  # the run's order: what restores
    except Exception as exc:  # retries spent re-raise the client's own error: not only ours
        if not is_storage_error(exc):
            raise
        echo(f"warning: could not list the checkpoints after the stop ({exc})")
        return record
    known = store.step_of(record.latest) if record.latest else None
    if newest < 0 or (known is not None and newest <= known):
        return record
    record = dataclasses.replace(record, latest=store.path_for(newest))
    if newest > max(restored_step, -1 if known is None else known):
        echo(f"checkpoint step {newest} was committed while the run stopped")
        record = dataclasses.replace(
            record, committed=record.committed + 1, committed_while_stopping=newest
        )
    return record


def resume_command(
    overrides: list[str], prep: Prepared, redactor: Redactor | None = None
) -> tuple[str, list[str]]:
    """The command that continues this run from its latest committed checkpoint, and notes on
    the secrets it leaves out (each is read from an environment variable the note names)."""
    redactor = redactor or Redactor()
    replaced = {"name", "resume", "checkpoint.storage_path"}
    kept, notes = [], []
    for override in overrides:
        if override_key(override) in replaced:
            continue
        text, note = redactor.override(override)
        kept.append(text)
        notes += [note] if note else []
    storage = redactor.text(prep.fs.unstrip_protocol(prep.storage_root))
    args = [*kept, f"name={prep.name}", "resume=true", f"checkpoint.storage_path={storage}"]
    return "python -m ftjob " + " ".join(shlex.quote(a) for a in args), notes


def _train_on_cluster(
    job: JobConfig,
    prep: Prepared,
    echo: Callable[[str], None],
    feed: LogFeed,
    keeper: LeaseKeeper,
    stop: StopSignal,
    outputs: OutputsMirror | None = None,
    held: HeldRecord | None = None,
    ray_died: Callable[[str], None] = lambda reason: None,
    started: float | None = None,
) -> tuple[RunSnapshot, FitEnd]:
    """Start the cluster, the ledger and the chaos killer; fit() on a thread while the main
    thread prints progress and services the simulated cluster; stop everything it started.
    Returns the ledger's final snapshot -- or the record the driver holds, where Ray died
    under the run (``ray_died(reason)`` is called at once, from the thread that saw it) --
    and how fit() ended."""
    stopped: FitEnd | None = None  # where the driver stopped the run's training, if it did
    stop.stage = "starting the cluster"
    with cluster(job) as local, contextlib.ExitStack() as run_actors:
        stop.install()  # ray.init put its own SIGTERM handler in
        watch = run_actors.enter_context(ray_death_watch(job, local, ray_died))
        check_resources(job, echo)  # an existing cluster: waits ray.resources_timeout
        _check_chaos_targets(job, echo)
        stop.stage = "starting the run ledger"
        ledger, killer = _start_run_actors(job, prep)
        memory, lease = job.checkpoint.memory, prep.lease  # holders: released before Ray stops
        check = lease_check(lease)
        holders = run_actors.enter_context(
            held_snapshots(prep.run, memory, prep.continues, echo, lease.generation, check)
        )
        monitor = Monitor(
            ledger, echo, local, keeper, feed, prep.redactor.text, outputs, held, started
        )
        fitting = FitThread(functools.partial(_fit, job, prep, ledger, holders))
        stop.training = True  # from now on SIGTERM is a preemption notice
        fitting.start()
        try:
            while fitting.is_alive() and watch.died is None:
                fitting.join(timeout=1.0)
                if watch.died is not None or not monitor.tick():
                    break  # Ray died; or another driver holds the run: stop writing to it now
                if monitor.ask("preemption", lambda: stop.done(ledger, echo)):
                    stopped = FitEnd(RunEnd.PREEMPTED)
                    break
        except KeyboardInterrupt:
            stopped = FitEnd(RunEnd.INTERRUPTED)
            echo("interrupted: stopping the run")
        finally:
            if killer is not None and watch.died is None:
                monitor.ask("stopping chaos", lambda: ask(killer, KillerActor.stop, 15))
            if watch.died is None:
                monitor.tick()
            snapshot = monitor.final_snapshot(watch.died)
    if watch.died is not None and stopped is None:
        stopped = FitEnd(RunEnd.RAY_DIED, watch.died)
    return snapshot, fit_end(fitting.error, stopped)


class FitThread(threading.Thread):
    """``TorchTrainer.fit()`` on a thread of its own (the main thread services the cluster
    and the monitor), and the error it raised, if any."""

    def __init__(self, fit: Callable[[], object]) -> None:
        super().__init__(name="ftjob-fit", daemon=True)
        self.fit = fit
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fit()
        except BaseException as exc:  # the thread's boundary: fit_end reads it
            self.error = exc


def _check_chaos_targets(job: JobConfig, echo: Callable[[str], None]) -> None:
    if job.chaos.takes_nodes() and not node_chaos_targets():
        echo(
            f"warning: chaos kind={job.chaos.kind}: every node of this cluster is the head or "
            "the driver's node, which chaos never takes away; each window will be skipped"
        )


@contextlib.contextmanager
def ray_death_watch(
    job: JobConfig, local: Any, ray_died: Callable[[str], None]
) -> Iterator[RayDeathWatch]:
    """The watch on the Ray this driver started (its raylet and GCS server: an embedded Ray's,
    a simulated cluster's head's), stopped before this driver shuts Ray down itself; on a
    cluster it only joined, a watch of nothing."""
    from ftjob.ray_internals import started_ray_processes

    processes = {}
    if job.ray.address is None:
        processes = started_ray_processes(local.cluster.head_node if local is not None else None)
    watch = RayDeathWatch(processes, ray_died).start()
    try:
        yield watch
    finally:
        watch.stop()


def run_plan(job: JobConfig, prep: Prepared) -> RunPlan:
    """What the run ledger knows of the run's shape from the start; with row-grouped data,
    the order's shuffle windows (the audit replays the order)."""
    plan = RunPlan(
        num_samples=prep.plan.num_samples,
        global_batch_size=prep.plan.global_batch_size,
        samples_per_epoch=prep.plan.samples_per_epoch,
        steps_per_epoch=prep.plan.steps_per_epoch,
        seed=prep.plan.seed,
        epochs=job.trainer.epochs,
        num_workers=job.trainer.num_workers,  # the most (elastic: min_workers the fewest)
    )
    windows = prep.plan.windows
    if windows is None:
        return plan
    return dataclasses.replace(
        plan,
        group_sizes=windows.sizes,
        group_counts=windows.counts,
        shuffle_window=windows.window,
    )


def worker_spec(
    job: JobConfig,
    prep: Prepared,
    ledger: Actor[RunLedger],
    catalogs: dict[str, Any],
    memory: Any = None,
) -> Any:
    """What every worker is handed (``catalogs``: the tables, or references to them;
    ``memory``: the memory tier's snapshot holder, when checkpoint.memory.enabled)."""
    from ftjob.worker.loop import WorkerSpec

    return WorkerSpec(
        job=job,
        dataset=prep.dataset,
        catalogs=catalogs,
        ledger=ledger,
        fs=prep.fs,
        run_path=prep.run_path,
        run_name=prep.name,
        data=prep.data,
        scratch=prep.scratch,
        fence=prep.lease.fence(),
        public_config=prep.public_config,
        memory=memory,
    )


def _start_run_actors(
    job: JobConfig, prep: Prepared
) -> tuple[Actor[RunLedger], Actor[KillerActor] | None]:
    from ftjob.chaos.killer import start_killer
    from ftjob.driver.ledger import start_ledger
    from ftjob.policy.hang import WatchConfig

    watch = WatchConfig.from_job(job)
    ledger = start_ledger(run_plan(job, prep), list(job.chaos.fail_at_steps), watch)
    killer = None
    if job.chaos.enabled:
        killer = start_killer(job.chaos, ledger)
    return ledger, killer


def _torch_trainer() -> Any:
    """Ray Train's TorchTrainer without its dataset integration. ftjob streams its own data
    (``ftjob.data.streams``), and the integration is not idle when no dataset is given: it starts a
    DatasetManager actor -- a new process -- with every attempt, on the controller's node
    (measured: 1.5 CPU-seconds while the new workers start, on a 2-core machine)."""
    from ray.train import torch as train_torch

    from ftjob.ray_internals import DatasetsCallback

    # Ray Train's v2 API is chosen at run time (RAY_TRAIN_V2_ENABLED): its type stubs are v1's.
    TorchTrainer: Any = train_torch.TorchTrainer

    class FtjobTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            return [
                c
                for c in super()._create_default_callbacks()
                if not isinstance(c, DatasetsCallback)
            ]

    return FtjobTorchTrainer


def ray_train_run(prep: Prepared) -> dict[str, str]:
    """Ray Train's run: named by the run's identity, not its name alone (a run of the same
    name with other storage may share the cluster, and Ray Train names each node's working
    directory by it), its bookkeeping under the run's own directory."""
    return {"name": prep.run.label, "storage_path": posixpath.join(prep.run_path, RAY_TRAIN_DIR)}


def _fit(job: JobConfig, prep: Prepared, ledger: Actor[RunLedger], holders: Any = None) -> object:
    """Runs TorchTrainer.fit() (on a thread: the main thread services the local cluster)."""
    import ray

    # Ray Train's v2 API is chosen at run time (RAY_TRAIN_V2_ENABLED): its type stubs are v1's.
    train: Any = importlib.import_module("ray.train")

    from ftjob.driver.drains import drain_relay
    from ftjob.driver.ledger import failure_watch
    from ftjob.driver.scaling import elastic_policy
    from ftjob.worker.loop import train_loop

    t = job.trainer
    spec = worker_spec(
        job,
        prep,
        ledger,
        {split: ray.put(table) for split, table in prep.catalogs.items()},
        holders,
    )
    # Ray Train's controller polls its workers this often: it bounds how late a failure is
    # noticed and how long a ray.train.report waits for the previous one to be taken.
    f = job.failure
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(f.health_check_interval)
    # Node drains reach the workers through the run ledger's process, not through a watcher
    # process Ray Train would start with every attempt (ftjob.driver.drains).
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    # Ray's dashboard (ray[default]) lists the run, its attempts and workers in its Train view
    # only with Ray Train's state tracking on: on for an existing cluster (the clusters ftjob
    # starts have no dashboard to show it); RAY_TRAIN_ENABLE_STATE_TRACKING=0 turns it off.
    if job.ray.address is not None:
        os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    trainer = _torch_trainer()(
        functools.partial(train_loop, spec),
        train_loop_config=prep.public_config,  # what Ray's dashboard shows: secrets redacted
        scaling_config=train.ScalingConfig(
            num_workers=(t.min_workers, t.num_workers) if t.elastic else t.num_workers,
            elastic_resize_monitor_interval_s=t.resize_interval,
            use_gpu=t.use_gpu,
            resources_per_worker=dict(t.resources_per_worker),
            placement_strategy=t.placement or ("SPREAD" if job.ray.local_nodes > 1 else "PACK"),
        ),
        run_config=train.RunConfig(
            **ray_train_run(prep),
            storage_filesystem=to_pyarrow(prep.fs),
            failure_config=train.FailureConfig(
                max_failures=f.max_failures,
                max_preemption_failures=f.max_preemptions,
                preemption_grace_s=f.preemption_grace_s,
                relax_collectives_on_preemption=f.relax_collectives_on_preemption,
            ),
            callbacks=[failure_watch(ledger), drain_relay(ledger, f.preemption_poll_interval)],
        ),
    )
    claim = f"ftjob-{prep.run.label}"  # the run's, whichever driver trains it
    with elastic_policy(ledger, claim) if t.elastic else contextlib.nullcontext():
        return trainer.fit()
