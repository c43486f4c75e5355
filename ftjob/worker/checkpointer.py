"""The checkpoint protocol of one training worker: everything between "the loop wants a
checkpoint at step S" and "every rank agreed and reported", and the way back (restore).

Saving: rank 0 writes model, optimizer and training state to a local scratch directory and
commits it through :class:`~ftjob.storage.checkpoint.CheckpointStore` (every file, then the manifest;
each request retried by the storage's retry policy) -- now (``sync``) or on a background
thread (``async``, one upload in flight). Each upload ends in an :class:`UploadOutcome` that is
sent to the run ledger the moment it ends. Storage errors that outlast the retry policy are
*tolerated* failures, counted against ``checkpoint.max_consecutive_upload_failures``; anything
else is a bug and propagates. Rank 0 broadcasts the verdict, so every rank either reports to
Ray Train (a barrier, with the step; the checkpoint stays ftjob's alone) or returns, together.
Retention is ftjob's too (:meth:`~ftjob.storage.checkpoint.CheckpointStore.prune`).

Restoring: rank 0 picks the newest checkpoint whose manifest verifies (moving aside any newer
one that does not) and broadcasts the choice; every rank downloads and loads it (timed:
download, load).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ftjob import metrics as M
from ftjob.config import CheckpointConfig
from ftjob.policy.cadence import CheckpointSchedule
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.lease import LeaseLost
from ftjob.storage.retry import is_storage_error
from ftjob.worker.collective import broadcast

logger = logging.getLogger("ftjob.worker.checkpointer")

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
CONFIG_FILE = "config.json"


def scratch_name(run_name: str) -> str:
    """The name of one driver's run scratch: unpredictable, so no other run of the same name
    (two sweep jobs with one ``name``), and no other user, shares or pre-creates it."""
    return f"ftjob-scratch-{run_name}-{secrets.token_hex(8)}"


def run_scratch_dir(name: str) -> str:
    """This node's scratch for one driver's run (``name`` from :func:`scratch_name`):
    checkpoints are written there, then uploaded. The driver removes it when the run ends;
    leftovers of killed attempts are removed by the next attempt on the node."""
    return os.path.join(tempfile.gettempdir(), name)


def _private_dir(path: str) -> str:
    """``path`` as a directory only this user can enter (0700): created so, or, when another
    process of the run created it first, checked to be ours and not a link to elsewhere."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(
                errno.EPERM,
                f"checkpoint scratch {path} exists but is not a private directory of this "
                "user: refusing to write checkpoints there",
            ) from None
    return path


def attempt_scratch_dir(name: str, attempt: int, rank: int) -> str:
    """Scratch of one worker of one attempt; leftovers of earlier attempts of this run on
    this node (a SIGKILLed worker cleans nothing) are removed first."""
    root = _private_dir(run_scratch_dir(name))
    for entry in os.listdir(root):
        number = entry[len("attempt") :].split("-", 1)[0] if entry.startswith("attempt") else ""
        if number.isdigit() and int(number) < attempt:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    path = os.path.join(root, f"attempt{attempt:04d}-rank{rank}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@dataclass
class TrainState:
    """Where training stands: the next step trains global batch ``position // B`` of ``epoch``."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    validated: bool = True  # the validation due at ``step`` ran to its end


@dataclass
class UploadOutcome:
    step: int
    path: str | None  # the committed checkpoint, None if the upload failed
    error: str | None
    seconds: float
    fatal: bool = False  # the run is another driver's now: no budget, the job stops


def upload_checkpoint(store: CheckpointStore, local_dir: str, step: int) -> UploadOutcome:
    """Commit ``local_dir`` as the checkpoint of ``step`` and remove it. A storage error that
    outlasted the retry policy becomes a failed outcome, a lost run lease a fatal one; any
    other error is a bug and raises."""
    start = time.perf_counter()
    fatal = False
    try:
        path, error = store.commit(local_dir, step), None
    except LeaseLost as exc:
        path, error, fatal = None, str(exc), True
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        path, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return UploadOutcome(step, path, error, time.perf_counter() - start, fatal)


def write_local_checkpoint(local_dir: str, tensors: dict[str, Any], records: dict[str, Any]) -> str:
    """Write one checkpoint's files into ``local_dir``: ``tensors`` with torch.save,
    ``records`` as JSON. A full or unwritable scratch disk raises an OSError that says where
    and how much room there was (the partial directory is removed)."""
    import torch

    try:
        os.makedirs(local_dir, exist_ok=True)
        # Through file objects: a full disk is then an OSError (ENOSPC), not torch's
        # unclassified RuntimeError from its own writer.
        for name, obj in tensors.items():
            with open(os.path.join(local_dir, name), "wb") as f:
                torch.save(obj, f)
        for name, record in records.items():
            with open(os.path.join(local_dir, name), "w") as f:
                json.dump(record, f, indent=1 if name == CONFIG_FILE else None)
    except OSError as exc:
        shutil.rmtree(local_dir, ignore_errors=True)
        parent = os.path.dirname(local_dir)
        try:
            free = f"{shutil.disk_usage(parent).free / 2**20:.0f} MB free there"
        except OSError:
            free = "its disk could not be asked"
        raise OSError(
            exc.errno,
            f"writing checkpoint scratch {local_dir} failed: {exc.strerror or exc} ({free}; "
            "point TMPDIR at a larger disk)",
        ) from exc
    return local_dir


class AsyncUploader:
    """Runs uploads on a background thread, one at a time, so training does not wait.

    ``submit`` blocks only while the previous upload is still running (at most one pending
    checkpoint is held locally). ``drain`` returns finished outcomes -- failures included, so
    none is lost -- and ``close`` waits for the pending upload. An upload that raises (a bug,
    not a storage error) re-raises in the training thread at the next ``submit``/``drain``/``close``.
    """

    def __init__(self, upload: Callable[[str, int], UploadOutcome]) -> None:
        self._upload = upload
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftjob-upload")
        self._pending: Future[UploadOutcome] | None = None
        self._done: list[UploadOutcome] = []

    def wait(self) -> float:
        """Wait for the pending upload; returns the seconds spent waiting."""
        start = time.perf_counter()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._done.append(pending.result())
        return time.perf_counter() - start

    def submit(self, local_dir: str, step: int) -> float:
        waited = self.wait()
        self._pending = self._pool.submit(self._upload, local_dir, step)
        return waited

    def drain(self) -> list[UploadOutcome]:
        if self._pending is not None and self._pending.done():
            self.wait()
        done, self._done = self._done, []
        return done

    def abandon(self) -> None:
        """Stop without waiting (the attempt is ending early): a running upload still ends
        and records its outcome; nothing new starts."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> list[UploadOutcome]:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
        return self.drain()


class NoUsableCheckpoint(RuntimeError):
    """Committed checkpoints exist, none verifies: starting over would silently lose them."""


@dataclass
class Restored:
    """A checkpoint located (state read) and then loaded into model and optimizer, and how
    long each took."""

    state: TrainState
    metrics: dict[str, float]
    path: str
    download_s: float
    load_s: float
    skipped: list[dict[str, Any]] = field(default_factory=list)
    local_dir: str = ""  # the downloaded copy, until loaded

    def record(self) -> dict[str, Any]:
        """The ledger's restore record (the loop adds the iterator's skip time)."""
        return {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "position": self.state.position,
            "path": self.path,
            "download": self.download_s,
            "load": self.load_s,
            "skipped": self.skipped,
        }


def prune_quietly(store: CheckpointStore, keep: int) -> None:
    """Retention is housekeeping: a failed delete only costs space, and is said."""
    try:
        store.prune(keep)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        logger.warning("pruning old checkpoints failed: %s", exc)


def choose_checkpoint(
    store: CheckpointStore, local_root: str, config: Any
) -> tuple[int, str, str, list[dict[str, Any]]] | str | None:
    """Rank 0: (step, path, local dir, quarantined) of the checkpoint to restore, None to
    start from step 0, or the error that stops the job. Whatever does not verify is
    quarantined on the way."""
    skipped: list[dict[str, Any]] = []
    result = store.restore_latest(local_root, skipped)
    for bad in skipped:
        bad["quarantined_to"] = store.quarantine(bad["step"], bad["reason"])
    if result is not None:
        return result.step, result.path, result.local_dir, skipped
    lost = [bad for bad in skipped if bad["committed"]]
    if not lost or config.restart_if_unrecoverable:
        return None
    details = "; ".join(f"step {b['step']}: {b['reason']}" for b in lost)
    return (
        f"no committed checkpoint of this run verifies ({details}); nothing was deleted: "
        f"they were moved to {store.quarantine_root}. Inspect them, or set "
        "checkpoint.restart_if_unrecoverable=true to start over from step 0"
    )


class Checkpointer:
    """One worker's side of saving, agreeing on, reporting and restoring checkpoints.

    ``fs`` is the run's retrying filesystem as the driver handed it to the worker."""

    def __init__(
        self,
        *,
        fs: Any,
        run_path: str,
        config: CheckpointConfig,
        job_config: dict[str, Any],
        rank: int,
        world: int,
        ledger: Any,
        attempt: int,
        metrics: M.MetricSet,
        local_root: str,
        data: dict[str, Any] | None = None,
        schedule: CheckpointSchedule | None = None,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.fs = fs
        self.schedule = schedule or CheckpointSchedule(0, None)
        self.data = data or {}
        self.store = CheckpointStore(fs, run_path, fence)
        self.config, self.job_config = config, job_config
        self.rank, self.world = rank, world
        self.ledger, self.attempt, self.metrics = ledger, attempt, metrics
        self.local_root = local_root
        self.source = f"attempt {attempt} rank {rank}"
        self.failed_uploads = 0
        self.last_error: str | None = None
        self.last_committed: str | None = None
        self.last_committed_step = -1
        self.upload_seconds = 0.0  # of the last committed upload: what a JIT checkpoint costs
        self.write_seconds = 0.0  # of the last local write
        self.report_seconds = 0.0  # of the last report barrier
        self.uploader: AsyncUploader | None = None
        if config.upload_mode == "async" and rank == 0:
            self.uploader = AsyncUploader(self._upload)

    # -- restore --------------------------------------------------------------------------

    def locate(self, global_batch: int) -> Restored | None:
        """Rank 0 picks the newest valid checkpoint; every rank has it downloaded and its
        state (step, data position) read; :meth:`load` then fills model and optimizer.
        Raises :class:`NoUsableCheckpoint` on every rank when committed checkpoints exist but
        none verifies (unless checkpoint.restart_if_unrecoverable)."""
        start = time.perf_counter()
        chosen: Any = None
        if self.rank == 0:
            chosen = choose_checkpoint(self.store, self.local_root, self.config)
        chosen = broadcast(chosen, self.world)
        if isinstance(chosen, str):
            raise NoUsableCheckpoint(chosen)
        if chosen is None:
            return None
        step, path, local_dir, skipped = chosen
        if self.rank != 0:
            local_dir = os.path.join(self.local_root, self.store.dir_name(step))
            self.store.download(step, local_dir)
        with open(os.path.join(local_dir, STATE_FILE)) as f:
            state = json.load(f)
        if state["global_batch_size"] != global_batch:
            raise RuntimeError(
                f"checkpoint {path} was trained with global batch {state['global_batch_size']}, this run uses "
                f"{global_batch}: resuming would break exact-once data order"
            )
        s = TrainState(
            state["step"], state["epoch"], state["position"], state.get("validated", True)
        )
        return Restored(
            s, state["metrics"], path, time.perf_counter() - start, 0.0, skipped, local_dir
        )

    def load(self, restored: Restored, module: Any, optimizer: Any, device: Any) -> None:
        """The located checkpoint's weights and optimizer state, into ``module`` and
        ``optimizer``; its local copy is removed."""
        import torch

        with self.metrics.timer(M.CHECKPOINT_LOAD):
            load_start = time.perf_counter()
            local = restored.local_dir
            # weights_only: tensors and plain containers, never pickled code -- a file planted
            # in shared storage must not run at resume (torch < 2.6 unpickles anything).
            module.load_state_dict(
                torch.load(os.path.join(local, MODEL_FILE), map_location=device, weights_only=True)
            )
            optimizer.load_state_dict(
                torch.load(
                    os.path.join(local, OPTIMIZER_FILE), map_location=device, weights_only=True
                )
            )
            restored.load_s = time.perf_counter() - load_start
        shutil.rmtree(local, ignore_errors=True)

    # -- save -----------------------------------------------------------------------------

    def _write_or_fail(
        self, state: TrainState, module: Any, optimizer: Any, global_batch: int
    ) -> str | UploadOutcome:
        """The local copy of this step's checkpoint, or (scratch full or unwritable) the
        failed outcome, recorded: a failed checkpoint like a failed upload, not a crash."""
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "position": state.position,
            "validated": state.validated,
            "global_batch_size": global_batch,
            "world_size": self.world,
            "metrics": self.metrics.state_dict(),
            "data": self.data,  # what resume=true checks the train data against
            "time": time.time(),
        }
        start = time.perf_counter()
        try:
            with self.metrics.timer(M.CHECKPOINT_SAVE):
                local_dir = write_local_checkpoint(
                    os.path.join(self.local_root, f"out_{state.step:09d}"),
                    {MODEL_FILE: module.state_dict(), OPTIMIZER_FILE: optimizer.state_dict()},
                    {STATE_FILE: record, CONFIG_FILE: self.job_config},
                )
        except OSError as exc:
            return self._record(UploadOutcome(state.step, None, f"OSError: {exc}", 0.0))
        self.write_seconds = time.perf_counter() - start
        return local_dir

    def _upload(self, local_dir: str, step: int) -> UploadOutcome:
        """Upload and record the outcome at once (any thread), so a worker dying right after
        cannot lose the record."""
        outcome = upload_checkpoint(self.store, local_dir, step)
        if outcome.path is not None:
            try:
                prune_quietly(self.store, self.config.num_to_keep)
            except LeaseLost as exc:  # committed just before another driver took the run
                outcome.error, outcome.fatal = str(exc), True
        return self._record(outcome)

    def _record(self, outcome: UploadOutcome) -> UploadOutcome:
        record = {
            "step": outcome.step,
            "path": outcome.path,
            "error": outcome.error,
            "seconds": outcome.seconds,
            "time": time.time(),
        }
        self.ledger.checkpoint.remote(self.attempt, record)
        self.send_storage_stats()
        return outcome

    def _account(self, outcomes: list[UploadOutcome]) -> str | None:
        """Soft-failure accounting on the training thread: the fatal error, if any."""
        fatal = None
        for outcome in outcomes:
            if outcome.fatal:
                fatal = fatal or outcome.error
                continue
            if outcome.path is not None:
                self.failed_uploads = 0
                self.last_committed = outcome.path
                self.last_committed_step = outcome.step
                self.upload_seconds = outcome.seconds
                continue
            self.failed_uploads += 1
            self.last_error = outcome.error
            allowed = self.config.max_consecutive_upload_failures
            if self.failed_uploads > allowed:
                fatal = (
                    f"{self.failed_uploads} checkpoint upload(s) in a row failed "
                    f"(checkpoint.max_consecutive_upload_failures={allowed}); last: {outcome.error}"
                )
        return fatal

    def save(self, state: TrainState, module: Any, optimizer: Any, global_batch: int) -> bool:
        """Save and upload (rank 0), agree on the outcome, report (every rank).
        False: the job must stop (every rank returns False together)."""
        fatal, start = None, time.perf_counter()
        if self.rank == 0:
            local_dir = self._write_or_fail(state, module, optimizer, global_batch)
            if isinstance(local_dir, UploadOutcome):
                fatal = self._account([local_dir])
            elif self.uploader is None:
                outcome = self._upload(local_dir, state.step)
                self.metrics.add(M.CHECKPOINT_UPLOAD, outcome.seconds)
                fatal = self._account([outcome])
            else:  # only the wait for a still-running previous upload stalls training
                self.metrics.add(M.CHECKPOINT_UPLOAD, self.uploader.submit(local_dir, state.step))
                fatal = self._account(self.uploader.drain())
            self._plan_next(state.step, time.perf_counter() - start + self.report_seconds)
        return self._agree_and_report(fatal, state)

    def _plan_next(self, step: int, cost_s: float) -> None:
        """Rank 0: the next periodic checkpoint (trainer.checkpoint_every_n_steps=auto: at the
        interval that wastes least for the cost measured so far -- write, upload and the last
        report barrier's length); said when it changes."""
        before = self.schedule.interval_steps
        self.schedule.saved(step, cost_s, self.metrics.seconds_per_step())
        if self.schedule.auto and self.schedule.interval_steps != before:
            self.ledger.log.remote(self.schedule.describe())

    def save_now(
        self,
        state: TrainState,
        module: Any,
        optimizer: Any,
        global_batch: int,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """A just-in-time checkpoint: this step, committed before it returns (every rank).
        A checkpoint of this step already committed (a periodic one, in flight when the
        notice came) is the JIT checkpoint. When the deadline leaves too little time for a
        checkpoint (judged by the last one's cost), none is started: the run falls back to the
        last committed one. Returns the record, the same on every rank."""
        record: dict[str, Any] = {"step": state.step}
        if self.rank == 0:
            start = time.perf_counter()
            if self.uploader is not None:  # let an upload in flight finish first
                self.uploader.wait()
                self._account(self.uploader.drain())
            needed = 1.5 * (self.write_seconds + self.upload_seconds) + 1.0
            left = math.inf if deadline is None else deadline - time.time()
            if self.last_committed_step == state.step:
                record.update(path=self.last_committed, reused=True)
            elif left < needed:
                record["reason"] = (
                    f"{left:.1f} s to the deadline, a checkpoint takes about {needed:.1f} s: "
                    f"falling back to the last committed one ({self.last_committed or 'none'})"
                )
            else:
                written = self._write_or_fail(state, module, optimizer, global_batch)
                outcome = (
                    written
                    if isinstance(written, UploadOutcome)
                    else self._upload(written, state.step)
                )
                self._account([outcome])
                record.update(path=outcome.path, reason=outcome.error)
            record["seconds"] = time.perf_counter() - start
        record = broadcast(record, self.world)
        if record.get("path"):
            self._report(state)
        return record

    def finish(self, state: TrainState) -> bool:
        """At the end of training, every rank: wait for a pending async upload and report it.
        A run must end with its final checkpoint committed: if the last upload failed (even
        within checkpoint.max_consecutive_upload_failures), the job fails and says so."""
        fatal = None
        if self.rank == 0:
            fatal = self._account(self.uploader.close()) if self.uploader is not None else None
            if fatal is None and self.failed_uploads:
                fatal = (
                    f"the final checkpoint (step {state.step}) was not committed: its upload "
                    f"failed ({self.last_error}); the newest committed checkpoint is "
                    f"{self.last_committed or 'none'}"
                )
        if self.config.upload_mode == "async":
            return self._agree_and_report(fatal, state)
        fatal = broadcast(fatal, self.world)
        if fatal and self.rank == 0:
            self.ledger.set_fatal.remote(fatal)
        return not fatal

    def close(self) -> None:
        """Stop the upload thread (an attempt that ends early) and drop local scratch."""
        if self.uploader is not None:
            self.uploader.abandon()
        shutil.rmtree(self.local_root, ignore_errors=True)

    def _agree_and_report(self, fatal: str | None, state: TrainState) -> bool:
        fatal, next_step = broadcast((fatal, self.schedule.next_step), self.world)
        self.schedule.follow(next_step)
        if fatal:
            if self.rank == 0:
                self.ledger.set_fatal.remote(fatal)
            return False
        self._report(state)
        return True

    def _report(self, state: TrainState) -> None:
        """Every rank: ray.train.report, a barrier and Ray Train's view of progress -- without
        the checkpoint: ftjob alone owns checkpoint directories (commit, restore, quarantine,
        retention), so Ray's run snapshot never names one ftjob moved or pruned."""
        import ray.train

        committed = self.last_committed if self.rank == 0 else None
        start = time.perf_counter()
        with self.metrics.timer(M.CHECKPOINT_REPORT):
            ray.train.report({"step": state.step, "epoch": state.epoch, "checkpoint": committed})
        self.report_seconds = time.perf_counter() - start

    def send_storage_stats(self) -> None:
        """This process's cumulative storage counters, to the ledger."""
        self.ledger.storage_stats.remote(self.source, self.fs.snapshot_stats().as_dict())


__all__ = [
    "AsyncUploader",
    "Checkpointer",
    "Restored",
    "TrainState",
    "UploadOutcome",
    "upload_checkpoint",
]
