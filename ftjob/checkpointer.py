"""The checkpoint protocol of one training worker: everything between "the loop wants a
checkpoint at step S" and "every rank agreed and reported", and the way back (restore).

Saving: rank 0 writes model, optimizer and training state to a local scratch directory and
commits it through :class:`~ftjob.checkpoint.CheckpointStore` (every file, then the manifest;
each request retried by the storage's retry policy) -- now (``sync``) or on a background
thread (``async``, one upload in flight). Each upload ends in an :class:`UploadOutcome` that is
sent to the run ledger the moment it ends. Storage errors that outlast the retry policy are
*tolerated* failures, counted against ``checkpoint.max_consecutive_upload_failures``; anything
else is a bug and propagates. Rank 0 broadcasts the verdict, so every rank either reports to
Ray Train (a barrier; rank 0 attaches the newest committed checkpoint, already uploaded:
``NO_UPLOAD``) or returns, together.

Restoring: rank 0 picks the newest checkpoint whose manifest verifies and broadcasts the
choice; every rank downloads and loads it (timed: download, load).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ftjob import metrics as M
from ftjob.checkpoint import CheckpointStore
from ftjob.collective import broadcast
from ftjob.config import CheckpointConfig
from ftjob.retry import is_storage_error

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
CONFIG_FILE = "config.json"


@dataclass
class TrainState:
    """Where training stands: the next step trains global batch ``position // B`` of ``epoch``."""

    step: int = 0
    epoch: int = 0
    position: int = 0


@dataclass
class UploadOutcome:
    step: int
    path: str | None  # the committed checkpoint, None if the upload failed
    error: str | None
    seconds: float


def upload_checkpoint(store: CheckpointStore, local_dir: str, step: int) -> UploadOutcome:
    """Commit ``local_dir`` as the checkpoint of ``step`` and remove it. A storage error that
    outlasted the retry policy becomes a failed outcome; any other error is a bug and raises."""
    start = time.perf_counter()
    try:
        path, error = store.commit(local_dir, step), None
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        path, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return UploadOutcome(step, path, error, time.perf_counter() - start)


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


@dataclass
class Restored:
    """A checkpoint loaded into the model and optimizer, and how long that took."""

    state: TrainState
    metrics: dict[str, float]
    path: str
    download_s: float
    load_s: float
    skipped: list[dict[str, Any]] = field(default_factory=list)

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


class Checkpointer:
    """One worker's side of saving, agreeing on, reporting and restoring checkpoints.

    ``fs`` is the run's retrying filesystem as the driver handed it to the worker;
    ``report_fs`` is Ray Train's view of the same storage (a checkpoint reported to Ray Train
    must name Ray's own filesystem object). ``source`` names this process in storage stats."""

    def __init__(
        self,
        *,
        fs: Any,
        report_fs: Any,
        run_path: str,
        config: CheckpointConfig,
        job_config: dict[str, Any],
        rank: int,
        world: int,
        ledger: Any,
        attempt: int,
        metrics: M.MetricSet,
        local_root: str,
    ) -> None:
        self.fs, self.report_fs = fs, report_fs
        self.store = CheckpointStore(fs, run_path)
        self.config, self.job_config = config, job_config
        self.rank, self.world = rank, world
        self.ledger, self.attempt, self.metrics = ledger, attempt, metrics
        self.local_root = local_root
        self.source = f"attempt {attempt} rank {rank}"
        self.failed_uploads = 0
        self.pending_report: UploadOutcome | None = None
        self.uploader: AsyncUploader | None = None
        if config.upload_mode == "async" and rank == 0:
            self.uploader = AsyncUploader(self._upload)

    # -- restore --------------------------------------------------------------------------

    def restore(
        self, module: Any, optimizer: Any, device: Any, global_batch: int
    ) -> Restored | None:
        """Rank 0 picks the newest valid checkpoint; every rank loads that one."""
        import torch

        start = time.perf_counter()
        chosen = None
        if self.rank == 0:
            result = self.store.restore_latest(self.local_root)
            if result is not None:
                self.store.delete_newer_than(result.step)
                chosen = (result.step, result.path, result.local_dir, result.skipped)
            elif self.store.steps():
                self.store.delete_newer_than(-1)
        chosen = broadcast(chosen, self.world)
        if chosen is None:
            return None
        step, path, local_dir, skipped = chosen
        if self.rank != 0:
            local_dir = os.path.join(self.local_root, self.store.dir_name(step))
            self.store.download(step, local_dir)
        download_s = time.perf_counter() - start
        with self.metrics.timer(M.CHECKPOINT_LOAD):
            load_start = time.perf_counter()
            with open(os.path.join(local_dir, STATE_FILE)) as f:
                state = json.load(f)
            module.load_state_dict(
                torch.load(os.path.join(local_dir, MODEL_FILE), map_location=device)
            )
            optimizer.load_state_dict(
                torch.load(os.path.join(local_dir, OPTIMIZER_FILE), map_location=device)
            )
            load_s = time.perf_counter() - load_start
        shutil.rmtree(local_dir, ignore_errors=True)
        if state["global_batch_size"] != global_batch:
            raise RuntimeError(
                f"checkpoint {path} was trained with global batch {state['global_batch_size']}, this run uses "
                f"{global_batch}: resuming would break exact-once data order"
            )
        return Restored(
            TrainState(step=state["step"], epoch=state["epoch"], position=state["position"]),
            state["metrics"],
            path,
            download_s,
            load_s,
            skipped,
        )

    # -- save -----------------------------------------------------------------------------

    def _write_local(
        self, state: TrainState, module: Any, optimizer: Any, global_batch: int
    ) -> str:
        import torch

        local_dir = os.path.join(self.local_root, f"out_{state.step:09d}")
        os.makedirs(local_dir, exist_ok=True)
        torch.save(module.state_dict(), os.path.join(local_dir, MODEL_FILE))
        torch.save(optimizer.state_dict(), os.path.join(local_dir, OPTIMIZER_FILE))
        record = {
            "step": state.step,
            "epoch": state.epoch,
            "position": state.position,
            "global_batch_size": global_batch,
            "world_size": self.world,
            "metrics": self.metrics.state_dict(),
            "time": time.time(),
        }
        with open(os.path.join(local_dir, STATE_FILE), "w") as f:
            json.dump(record, f)
        with open(os.path.join(local_dir, CONFIG_FILE), "w") as f:
            json.dump(self.job_config, f, indent=1)
        return local_dir

    def _upload(self, local_dir: str, step: int) -> UploadOutcome:
        """Upload and record the outcome at once (any thread), so a worker dying right after
        cannot lose the record."""
        outcome = upload_checkpoint(self.store, local_dir, step)
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
            if outcome.path is not None:
                self.failed_uploads = 0
                self.pending_report = outcome
                continue
            self.failed_uploads += 1
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
        fatal = None
        if self.rank == 0:
            with self.metrics.timer(M.CHECKPOINT_SAVE):
                local_dir = self._write_local(state, module, optimizer, global_batch)
            if self.uploader is None:
                outcome = self._upload(local_dir, state.step)
                self.metrics.add(M.CHECKPOINT_UPLOAD, outcome.seconds)
                fatal = self._account([outcome])
            else:  # only the wait for a still-running previous upload stalls training
                self.metrics.add(M.CHECKPOINT_UPLOAD, self.uploader.submit(local_dir, state.step))
                fatal = self._account(self.uploader.drain())
        return self._agree_and_report(fatal, state)

    def finish(self, state: TrainState) -> bool:
        """At the end of training, every rank: wait for a pending async upload and report it."""
        if self.config.upload_mode != "async":
            return True
        fatal = self._account(self.uploader.close()) if self.uploader is not None else None
        return self._agree_and_report(fatal, state)

    def close(self) -> None:
        """Stop the upload thread (an attempt that ends early) and drop local scratch."""
        if self.uploader is not None:
            self.uploader.abandon()
        shutil.rmtree(self.local_root, ignore_errors=True)

    def _agree_and_report(self, fatal: str | None, state: TrainState) -> bool:
        fatal = broadcast(fatal, self.world)
        if fatal:
            if self.rank == 0:
                self.ledger.set_fatal.remote(fatal)
            return False
        self._report(state)
        return True

    def _report(self, state: TrainState) -> None:
        """Every rank calls ray.train.report (a barrier); rank 0 attaches the newest committed
        checkpoint, which ftjob already uploaded (NO_UPLOAD)."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        checkpoint, name = None, None
        if self.rank == 0 and self.pending_report is not None:
            checkpoint = Checkpoint(path=self.pending_report.path, filesystem=self.report_fs)
            name = self.store.dir_name(self.pending_report.step)
            self.pending_report = None
        name = broadcast(name, self.world)
        with self.metrics.timer(M.CHECKPOINT_REPORT):
            ray.train.report(
                {"step": state.step, "epoch": state.epoch},
                checkpoint=checkpoint,
                checkpoint_dir_name=name,
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )

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
