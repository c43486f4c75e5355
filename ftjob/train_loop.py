"""The per-worker training function. Ray Train runs it on every worker and runs it again,
from the latest valid checkpoint, after a failure.

Each attempt: register with the ledger -> restore (timed: download, load) -> position the
resumable iterator after the last trained sample (timed: skip) -> train, validating every N
steps and checkpointing every M steps (rank 0 writes and uploads, every rank reports).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ray.train import Checkpoint, CheckpointUploadMode

from ftjob import metrics as M
from ftjob.checkpoint import AsyncUploader, CheckpointStore, UploadOutcome
from ftjob.config import JobConfig, to_plain
from ftjob.data import (
    EPOCH_END,
    BatchFeeder,
    EpochPlan,
    RayDataStream,
    ResumableIterator,
    ValidationSet,
    validation_ids,
)
from ftjob.datasets import TRAIN, VAL, ImageDataset
from ftjob.models import build_model
from ftjob.storage import set_fault_stream


class InjectedFailure(RuntimeError):
    """Raised at a step listed in chaos.fail_at_steps (once per run)."""


@dataclass
class TrainState:
    """Where training stands: the next step trains global batch ``position // B`` of ``epoch``."""

    step: int = 0
    epoch: int = 0
    position: int = 0


@dataclass
class WorkerSpec:
    """What the driver hands every worker: plain, resolved data and handles."""

    job: JobConfig
    dataset: ImageDataset
    catalogs: dict[str, Any]  # split -> ObjectRef of a pyarrow.Table
    ledger: Any  # ActorHandle[RunLedger]
    run_path: str  # the run's directory on the storage filesystem


def _broadcast(obj: Any, world_size: int) -> Any:
    """``obj`` from rank 0 on every rank."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for step-local randomness (dropout...): the same whichever attempt runs the step."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class Worker:
    """One training worker's attempt. ``run()`` is the whole attempt."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.job = job = spec.job
        self.trainer = job.trainer
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        storage = ctx.get_storage()
        self.pa_fs = storage.storage_filesystem
        self.fs = self.pa_fs.handler.fs  # our RetryingFileSystem
        self.store = CheckpointStore(self.fs, spec.run_path)
        self.ledger = spec.ledger
        self.metrics = M.MetricSet()
        self.state = TrainState()
        self.device = ray.train.torch.get_device()
        torch.set_num_threads(max(1, int(self.trainer.worker_cpus)))
        self.catalogs = {split: ray.get(ref) for split, ref in spec.catalogs.items()}
        self.plan = EpochPlan(
            self.catalogs[TRAIN].num_rows, self.trainer.global_batch_size, self.trainer.seed
        )
        self.total_steps = self.plan.steps_per_epoch * self.trainer.epochs
        self.local_root = tempfile.mkdtemp(prefix="ftjob-ckpt-")
        self.uploader: AsyncUploader | None = None
        self.failed_uploads = 0
        self.validated_step = -1
        self.pending_report: dict[str, Any] | None = None
        self.restore_info: dict[str, Any] | None = None

    # -- setup ----------------------------------------------------------------------------

    def _register(self) -> None:
        attempt = ray.get(self.ledger.begin_attempt.remote(time.time())) if self.rank == 0 else None
        self.attempt = _broadcast(attempt, self.world)
        set_fault_stream(self.fs, f"attempt {self.attempt} rank {self.rank}")
        ctx = ray.get_runtime_context()
        self.ledger.register_worker.remote(
            self.attempt,
            self.rank,
            {
                "node_id": ctx.get_node_id(),
                "pid": os.getpid(),
                "raylet_pid": os.getppid(),
                "time": time.time(),
            },
        )

    def _build(self) -> None:
        torch.manual_seed(self.trainer.seed)
        model = build_model(self.job.model, self.spec.dataset.num_classes)
        if self.trainer.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = ray.train.torch.prepare_model(model)
        self.module = self.model.module if hasattr(self.model, "module") else self.model
        params, t = self.module.parameters(), self.trainer
        if t.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
            )
        elif t.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        self.autocast = self.trainer.precision == "bf16"
        pin = self.device.type == "cuda"
        common = {
            "seed": self.trainer.seed,
            "device": self.device,
            "prefetch_batches": self.trainer.prefetch_batches,
            "decode_cpus": self.trainer.decode_cpus,
            "window_mb": self.trainer.decode_window_mb,
            "pin_memory": pin,
            "channels_last": self.trainer.channels_last,
        }
        train_stream = RayDataStream(self.spec.dataset, self.catalogs[TRAIN], TRAIN, **common)
        val_stream = RayDataStream(self.spec.dataset, self.catalogs[VAL], VAL, **common)
        self.val_set = ValidationSet(
            val_stream,
            validation_ids(self.catalogs[VAL].num_rows, self.rank, self.world),
            self.trainer.val_batch_size or self.trainer.batch_size,
            self.trainer.validation_cache_mb * 2**20,
        )
        self.iterator = ResumableIterator(train_stream, self.plan, self.rank, self.world)

    # -- restore --------------------------------------------------------------------------

    def _restore(self) -> None:
        """Rank 0 picks the newest valid checkpoint; every rank loads that one."""
        download_s = load_s = 0.0
        start = time.perf_counter()
        chosen = None
        if self.rank == 0:
            result = self.store.restore_latest(self.local_root)
            chosen = (
                None
                if result is None
                else (result.step, result.path, result.local_dir, result.skipped)
            )
            if result is not None:
                self.store.delete_newer_than(result.step)
            elif self.store.steps():
                self.store.delete_newer_than(-1)
        chosen = _broadcast(chosen, self.world)
        if chosen is None:
            return
        step, path, local_dir, skipped = chosen
        if self.rank != 0:
            local_dir = os.path.join(self.local_root, self.store.dir_name(step))
            self.store.download(step, local_dir)
        download_s = time.perf_counter() - start
        with self.metrics.timer(M.CHECKPOINT_LOAD):
            load_start = time.perf_counter()
            state = json.loads(open(os.path.join(local_dir, "state.json")).read())
            self.module.load_state_dict(
                torch.load(os.path.join(local_dir, "model.pt"), map_location=self.device)
            )
            self.optimizer.load_state_dict(
                torch.load(os.path.join(local_dir, "optimizer.pt"), map_location=self.device)
            )
            load_s = time.perf_counter() - load_start
        if state["global_batch_size"] != self.plan.global_batch_size:
            raise RuntimeError(
                f"checkpoint {path} was trained with global batch {state['global_batch_size']}, this run uses "
                f"{self.plan.global_batch_size}: resuming would break exact-once data order"
            )
        shutil.rmtree(local_dir, ignore_errors=True)
        self.metrics.load_state_dict(state["metrics"])
        self.state = TrainState(
            step=state["step"], epoch=state["epoch"], position=state["position"]
        )
        self.validated_step = self.state.step
        self.restore_info = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "position": self.state.position,
            "path": path,
            "download": download_s,
            "load": load_s,
            "skipped": skipped,
        }
        self.metrics.add(M.CHECKPOINT_DOWNLOAD, download_s)

    # -- checkpoint -----------------------------------------------------------------------

    def _write_local(self) -> str:
        local_dir = os.path.join(self.local_root, f"out_{self.state.step:09d}")
        os.makedirs(local_dir, exist_ok=True)
        torch.save(self.module.state_dict(), os.path.join(local_dir, "model.pt"))
        torch.save(self.optimizer.state_dict(), os.path.join(local_dir, "optimizer.pt"))
        state = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "position": self.state.position,
            "global_batch_size": self.plan.global_batch_size,
            "world_size": self.world,
            "metrics": self.metrics.state_dict(),
            "time": time.time(),
        }
        with open(os.path.join(local_dir, "state.json"), "w") as f:
            json.dump(state, f)
        with open(os.path.join(local_dir, "config.json"), "w") as f:
            json.dump(to_plain(self.job), f, indent=1)
        return local_dir

    def _upload_done(self, outcome: UploadOutcome) -> None:
        """Record a finished upload in the ledger. Any thread: the async uploader calls it the
        moment an upload ends, so a worker dying right after cannot lose the record."""
        record = {
            "step": outcome.step,
            "path": outcome.path,
            "error": outcome.error,
            "seconds": outcome.seconds,
            "time": time.time(),
        }
        self.ledger.checkpoint.remote(self.attempt, record)
        self._send_storage_stats()

    def _send_storage_stats(self) -> None:
        stats = self.fs.snapshot_stats().as_dict()
        self.ledger.storage_stats.remote(f"attempt {self.attempt} rank {self.rank}", stats)

    def _account(self, outcomes: list[UploadOutcome]) -> str | None:
        """Soft-failure accounting on the training thread: the fatal error, if any."""
        fatal = None
        for outcome in outcomes:
            if outcome.path is not None:
                self.failed_uploads = 0
                self.pending_report = {"step": outcome.step, "path": outcome.path}
                continue
            self.failed_uploads += 1
            allowed = self.job.checkpoint.max_consecutive_upload_failures
            if self.failed_uploads > allowed:
                fatal = (
                    f"{self.failed_uploads} checkpoint upload(s) in a row failed "
                    f"(checkpoint.max_consecutive_upload_failures={allowed}); last: {outcome.error}"
                )
        return fatal

    def _upload_now(self, local_dir: str) -> UploadOutcome:
        start = time.perf_counter()
        try:
            path, error = self.store.commit(local_dir, self.state.step), None
        except Exception as exc:
            path, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        outcome = UploadOutcome(self.state.step, path, error, time.perf_counter() - start)
        self._upload_done(outcome)
        return outcome

    def _checkpoint(self) -> bool:
        """Save and upload (rank 0), agree on the outcome, report. False: the job must stop."""
        fatal = None
        if self.rank == 0:
            with self.metrics.timer(M.CHECKPOINT_SAVE):
                local_dir = self._write_local()
            if self.uploader is None:
                outcome = self._upload_now(local_dir)
                self.metrics.add(M.CHECKPOINT_UPLOAD, outcome.seconds)
                fatal = self._account([outcome])
            else:  # only the wait for a still-running previous upload stalls training
                waited = self.uploader.submit(local_dir, self.state.step)
                self.metrics.add(M.CHECKPOINT_UPLOAD, waited)
                fatal = self._account(self.uploader.drain())
        return self._agree_and_report(fatal)

    def _finish_uploads(self) -> bool:
        """Async mode, every rank, at the end: wait for the pending upload, then report it."""
        fatal = self._account(self.uploader.close()) if self.uploader is not None else None
        return self._agree_and_report(fatal)

    def _agree_and_report(self, fatal: str | None) -> bool:
        fatal = _broadcast(fatal, self.world)
        if fatal:
            if self.rank == 0:
                self.ledger.set_fatal.remote(fatal)
            return False
        self._report()
        return True

    def _report(self) -> None:
        """Every rank calls ray.train.report (a barrier); rank 0 attaches the newest committed
        checkpoint, which ftjob already uploaded (NO_UPLOAD)."""
        checkpoint, name = None, None
        if self.rank == 0 and self.pending_report is not None:
            checkpoint = Checkpoint(path=self.pending_report["path"], filesystem=self.pa_fs)
            name = self.store.dir_name(self.pending_report["step"])
            self.pending_report = None
        name = _broadcast(name, self.world)
        with self.metrics.timer(M.CHECKPOINT_REPORT):
            ray.train.report(
                {"step": self.state.step, "epoch": self.state.epoch},
                checkpoint=checkpoint,
                checkpoint_dir_name=name,
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )

    # -- validation -----------------------------------------------------------------------

    @torch.inference_mode()
    def _validate(self, epoch: int) -> None:
        if self.validated_step == self.state.step:
            return
        self.validated_step = self.state.step
        with self.metrics.timer(M.VALIDATION_STEP):
            self.module.eval()
            totals = torch.zeros(3, dtype=torch.float64, device=self.device)
            for batch in self.val_set:
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    logits = self.module(batch.images)
                totals[0] += F.cross_entropy(logits.float(), batch.labels, reduction="sum")
                totals[1] += (logits.argmax(1) == batch.labels).sum()
                totals[2] += len(batch.labels)
            if self.world > 1:
                dist.all_reduce(totals)
            loss, correct, count = totals.tolist()
            self.module.train()
        result = {
            "epoch": epoch,
            "loss": loss / max(count, 1),
            "accuracy": correct / max(count, 1),
            "samples": int(count),
            "time": time.time(),
        }
        self.metrics.set(M.VALIDATION_LOSS, result["loss"])
        self.metrics.set(M.VALIDATION_ACCURACY, result["accuracy"])
        if self.rank == 0:
            self.ledger.validation.remote(self.attempt, self.state.step, result)

    # -- training -------------------------------------------------------------------------

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(_step_seed(self.trainer.seed, self.state.step, self.rank))
        lr = self.trainer.lr_at(self.state.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = F.cross_entropy(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _log_progress(
        self, loss_sum: torch.Tensor, loss_steps: int, window_start: float, window_rows: int
    ) -> None:
        loss = float(loss_sum.item()) / max(loss_steps, 1)  # the one host sync per log interval
        throughput = window_rows / max(time.perf_counter() - window_start, 1e-9)
        self.metrics.set(M.TRAIN_LOSS, loss)
        if self.rank == 0:
            progress = {
                "step": self.state.step,
                "epoch": self.state.epoch,
                "epochs": self.trainer.epochs,
                "total_steps": self.total_steps,
                "loss": loss,
                "throughput": throughput,
                "time": time.time(),
            }
            self.ledger.progress_update.remote(self.attempt, progress, self.metrics.as_dict())

    def _maybe_fail(self) -> None:
        if self.rank == 0 and self.state.step in self.job.chaos.fail_at_steps:
            if ray.get(self.ledger.claim_injected_failure.remote(self.state.step, time.time())):
                raise InjectedFailure(
                    f"chaos.fail_at_steps: injected failure at step {self.state.step}"
                )

    def _start_feeder(self) -> BatchFeeder:
        """Position the iterator after the last trained sample (timed: the skip) and report
        the restore; then stream batches from there to the end of training."""
        t = self.trainer
        start = time.perf_counter()
        first = (
            self.iterator.epoch(self.state.epoch, self.state.position)
            if self.state.epoch < t.epochs
            else iter(())
        )
        skip_s = time.perf_counter() - start
        self.metrics.add(M.TRAIN_ITER_SKIP_BATCH, skip_s)
        self._send_storage_stats()
        if self.rank == 0 and self.restore_info is not None:
            self.ledger.restored.remote(self.attempt, {**self.restore_info, "skip": skip_s})
        return BatchFeeder(
            self.iterator,
            first,
            self.state.epoch,
            t.epochs,
            depth=max(1, t.prefetch_batches),
            first_steps=self.plan.steps_per_epoch
            - self.state.position // self.plan.global_batch_size,
            steps_per_epoch=self.plan.steps_per_epoch,
        )

    def run(self) -> None:
        self._register()
        self._build()
        self._restore()
        if self.job.checkpoint.upload_mode == "async" and self.rank == 0:
            self.uploader = AsyncUploader(
                self.store.commit,
                lambda d: shutil.rmtree(d, ignore_errors=True),
                on_done=self._upload_done,
            )
        feeder = self._start_feeder()
        try:
            if not self._train(feeder):
                return
        finally:
            feeder.close()
            self.val_set.close()
        if self.job.checkpoint.upload_mode == "async" and not self._finish_uploads():
            return
        self._send_storage_stats()
        if self.rank == 0:
            self._log_final()
            self.ledger.finish.remote(time.time())

    def _train(self, feeder: BatchFeeder) -> bool:
        """Train to the end; False if the job must stop (a fatal upload failure)."""
        t, B = self.trainer, self.plan.global_batch_size
        first_step_done, new_epoch = False, True
        loss_sum, loss_steps = torch.zeros((), device=self.device), 0
        window_start, window_rows = time.perf_counter(), 0
        wait_start = time.perf_counter()
        for epoch, batch in feeder:
            waited = time.perf_counter() - wait_start
            if batch is EPOCH_END:
                # Epoch end: position wraps to the next epoch before the checkpoint is written.
                self.state.epoch, self.state.position = epoch + 1, 0
                self._validate(epoch)
                if not self._checkpoint():
                    return False
                new_epoch = True
                wait_start = time.perf_counter()
                continue
            self.metrics.add(M.TRAIN_ITER_FIRST_BATCH if new_epoch else M.TRAIN_ITER_BATCH, waited)
            new_epoch = False
            with self.metrics.timer(M.TRAIN_STEP):
                loss_sum += self._train_step(batch.images, batch.labels)
            loss_steps += 1
            self.state.step += 1
            self.state.position += B
            window_rows += B
            self.metrics.add(M.TRAIN_ROWS_PROCESSED, B)
            self.metrics.set(M.TRAIN_STEPS_COMPLETED, self.state.step)
            if t.audit_samples:
                self.ledger.audit_step.remote(
                    self.attempt, self.state.step, epoch, batch.ids.tolist()
                )
            if self.rank == 0:
                self.ledger.step_done.remote(self.attempt, self.state.step)
                if not first_step_done:
                    self.ledger.first_step.remote(self.attempt, self.state.step, time.time())
            if not first_step_done:
                # Training is flowing: decode the validation set into its cache meanwhile.
                self.val_set.prefetch()
            first_step_done = True
            self._maybe_fail()
            if self.state.step % t.log_every_n_steps == 0:
                self._log_progress(loss_sum, loss_steps, window_start, window_rows)
                loss_sum, loss_steps = torch.zeros((), device=self.device), 0
                window_start, window_rows = time.perf_counter(), 0
            # The epoch's last step validates and checkpoints at EPOCH_END.
            if self.state.position < self.plan.samples_per_epoch:
                if t.validate_every_n_steps and self.state.step % t.validate_every_n_steps == 0:
                    self._validate(epoch)
                if t.checkpoint_every_n_steps and self.state.step % t.checkpoint_every_n_steps == 0:
                    if not self._checkpoint():
                        return False
            wait_start = time.perf_counter()
        return True

    def _log_final(self) -> None:
        busy = self.metrics.get(M.TRAIN_STEP) + self.metrics.get(M.TRAIN_ITER_BATCH)
        progress = {
            "step": self.state.step,
            "epoch": self.state.epoch - 1,
            "epochs": self.trainer.epochs,
            "total_steps": self.total_steps,
            "loss": self.metrics.get(M.TRAIN_LOSS),
            "throughput": self.metrics.get(M.TRAIN_ROWS_PROCESSED) / max(busy, 1e-9),
            "time": time.time(),
        }
        self.ledger.progress_update.remote(self.attempt, progress, self.metrics.as_dict())


def train_loop(spec: WorkerSpec) -> None:
    """Entry point handed to TorchTrainer (train_loop_config is the WorkerSpec)."""
    worker = Worker(spec)
    try:
        worker.run()
    finally:
        shutil.rmtree(worker.local_root, ignore_errors=True)
