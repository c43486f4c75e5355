"""The per-worker training function. Ray Train runs it on every worker and runs it again,
from the latest valid checkpoint, after a failure.

Each attempt: register with the ledger -> restore (timed: download, load) -> position the
resumable iterator after the last trained sample (timed: skip) -> train, validating every N
steps and checkpointing every M steps (rank 0 writes and uploads, every rank reports).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftjob import metrics as M
from ftjob.config import JobConfig
from ftjob.data.datasets import TRAIN, VAL, ImageDataset, data_error_of
from ftjob.data.order import EpochPlan, validation_ids
from ftjob.data.streams import (
    EPOCH_END,
    BatchFeeder,
    RayDataStream,
    ResumableIterator,
    ValidationSet,
)
from ftjob.policy.cadence import CheckpointSchedule
from ftjob.policy.elastic import micro_batches
from ftjob.storage.faults import set_fault_stream
from ftjob.storage.fs import RetryingFileSystem
from ftjob.storage.lease import LeaseFence
from ftjob.worker.checkpointer import (
    Checkpointer,
    NoUsableCheckpoint,
    Restored,
    TrainState,
    attempt_scratch_dir,
)
from ftjob.worker.collective import broadcast
from ftjob.worker.heartbeat import Heartbeat
from ftjob.worker.models import build_model
from ftjob.worker.optim import LRSchedule, build_optimizer, parameter_groups
from ftjob.worker.preemption import PreemptionNotices


def build_streams(
    dataset: ImageDataset,
    catalogs: dict[str, Any],
    trainer: Any,
    device: torch.device,
    plan: EpochPlan,
    rank: int,
    world: int,
    note: Callable[[str], None] | None = None,
) -> tuple[ValidationSet, ResumableIterator]:
    """This rank's validation set and resumable training iterator, decoded in Ray Data;
    ``note`` hears what the user should know (a validation set too big to cache)."""
    common = {
        "seed": trainer.seed,
        "device": device,
        "prefetch_batches": trainer.prefetch_batches,
        "decode_cpus": trainer.decode_cpus,
        "window_mb": trainer.decode_window_mb,
        "pin_memory": device.type == "cuda",
        "channels_last": trainer.channels_last,
    }
    train_stream = RayDataStream(dataset, catalogs[TRAIN], TRAIN, local_first_window=True, **common)
    val_stream = RayDataStream(dataset, catalogs[VAL], VAL, **common)
    val_set = ValidationSet(
        val_stream,
        validation_ids(catalogs[VAL].num_rows, rank, world),
        trainer.val_batch_size or trainer.batch_size,
        trainer.validation_cache_mb * 2**20,
        note,
    )
    return val_set, ResumableIterator(train_stream, plan, rank, world)


def start_phases(started: dict[str, float], waited: float, took: float) -> dict[str, float]:
    """Where an attempt's start went in a worker: process group (the train function's entry to
    the first collective, the ledger's answer included), model (notices, model, DDP,
    optimizer), first batch (its wait after the restore and the stream's start), first step."""
    return {
        "process_group": started["registered"] - started["entered"],
        "model": started["built"] - started["registered"],
        "first_batch": waited,
        "first_step": took - waited,
    }


def make_checkpointer(
    spec: WorkerSpec, rank: int, world: int, attempt: int, metrics: M.MetricSet
) -> Checkpointer:
    return Checkpointer(
        fs=spec.fs,
        run_path=spec.run_path,
        config=spec.job.checkpoint,
        job_config=spec.public_config,
        data=spec.data,
        rank=rank,
        world=world,
        ledger=spec.ledger,
        attempt=attempt,
        metrics=metrics,
        local_root=attempt_scratch_dir(spec.scratch, attempt, rank),
        schedule=CheckpointSchedule(
            spec.job.trainer.checkpoint_every_n_steps, spec.job.failure.expected_mtbf_s
        ),
        fence=spec.fence,
    )


def open_streams(
    spec: WorkerSpec,
    catalogs: dict[str, Any],
    device: torch.device,
    plan: EpochPlan,
    rank: int,
    world: int,
    state: TrainState,
) -> tuple[ValidationSet, BatchFeeder, float]:
    """This rank's validation set, and its training batches from ``state``'s position to the
    end of training (the epoch's stream starts at the position: nothing before it is read),
    already decoding; and how long positioning took (the skip)."""
    trainer = spec.job.trainer
    note = spec.ledger.log.remote if rank == 0 else None  # one line for the run, not per rank
    val_set, iterator = build_streams(
        spec.dataset, catalogs, trainer, device, plan, rank, world, note
    )
    start = time.perf_counter()
    first = (
        iterator.epoch(state.epoch, state.position) if state.epoch < trainer.epochs else iter(())
    )
    feeder = BatchFeeder(
        iterator,
        first,
        state.epoch,
        trainer.epochs,
        depth=max(1, trainer.prefetch_batches),
        first_steps=plan.steps_per_epoch - state.position // plan.global_batch_size,
        steps_per_epoch=plan.steps_per_epoch,
    )
    return val_set, feeder, time.perf_counter() - start


class LossWindow:
    """The training loss since the last progress line, summed on the device: read back (the
    one host sync) and all-reduced across ranks only at a progress line or a checkpoint."""

    def __init__(self, device: torch.device, world: int) -> None:
        self.device, self.world = device, world
        self.last_finite_step = 0
        self._reset()

    def _reset(self) -> None:
        self.total = torch.zeros((), device=self.device)
        self.steps, self.rows, self.started = 0, 0, time.perf_counter()

    def add(self, loss: torch.Tensor, rows: int) -> None:
        self.total += loss
        self.steps += 1
        self.rows += rows

    def peek(self, step: int) -> float:
        """The mean loss of the window over every rank (inf or nan if any rank's was)."""
        summed = torch.stack(
            [self.total.float(), torch.tensor(float(self.steps), device=self.device)]
        )
        if self.world > 1:
            dist.all_reduce(summed)
        loss_sum, steps = summed.tolist()
        loss = loss_sum / steps if steps else 0.0
        if math.isfinite(loss):
            self.last_finite_step = step
        return loss

    def read(self, step: int) -> tuple[float, float]:
        """(mean loss, images/s of this rank) of the window, which then starts anew."""
        loss = self.peek(step)
        throughput = self.rows / max(time.perf_counter() - self.started, 1e-9)
        self._reset()
        return loss, throughput


@torch.inference_mode()
def evaluate(
    module: torch.nn.Module,
    batches: Any,
    device: torch.device,
    autocast: bool,
    world: int,
    stop: Callable[[], bool] | None = None,
) -> tuple[float, float, float, bool]:
    """(summed loss, correct, count, complete) over every rank's validation shard. ``stop``
    (a preemption notice) cuts it short; every rank still meets in the final all-reduce, and
    the result counts only if no rank stopped."""
    module.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for batch in batches:
        if stop is not None and stop():
            totals[3] = 1
            break
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = module(batch.images)
        totals[0] += F.cross_entropy(logits.float(), batch.labels, reduction="sum")
        totals[1] += (logits.argmax(1) == batch.labels).sum()
        totals[2] += len(batch.labels)
    if world > 1:
        dist.all_reduce(totals)
    module.train()
    loss, correct, count, stopped = totals.tolist()
    return loss, correct, count, not stopped


def divergence(loss: float, step: int, last_finite_step: int) -> str:
    return (
        f"training diverged: the loss became non-finite ({loss}) by step {step} (last finite "
        f"at step {last_finite_step}); not retried, and no checkpoint of the diverged weights "
        "was written (trainer.stop_on_nonfinite_loss=false trains on)"
    )


def end_on_data_error(exc: BaseException, ledger: Any, world: int) -> None:
    """Called with the exception that ended training on this rank; returns if the rank is to
    return, raises otherwise. A file that cannot be decoded (a DataError) fails again on every
    attempt: it becomes the run's fatal error, not a failure for failure.max_failures to
    absorb, and one worker returns. With several, the ranks whose slices do not hold the file
    are blocked in a collective with this one -- gloo waits for as long as this process lives
    -- so the attempt fails instead (the DataError is raised): Ray Train ends the group at
    once, and its restart ends at its start, as the ledger holds a fatal error."""
    error = data_error_of(exc)
    if error is None:
        raise exc
    ray.get(ledger.set_fatal.remote(str(error)), timeout=60)
    if world > 1:
        raise error from exc


class InjectedFailure(RuntimeError):
    """Raised at a step listed in chaos.fail_at_steps (once per run)."""


def maybe_inject_failure(ledger: Any, step: int, fail_at_steps: list[int]) -> None:
    """Rank 0: raise at a step of chaos.fail_at_steps, once per run (the ledger keeps count)."""
    if step in fail_at_steps and ray.get(ledger.claim_injected_failure.remote(step, time.time())):
        raise InjectedFailure(f"chaos.fail_at_steps: injected failure at step {step}")


@dataclass
class WorkerSpec:
    """What the driver hands every worker: plain, resolved data and handles."""

    job: JobConfig
    dataset: ImageDataset
    catalogs: dict[str, Any]  # split -> ObjectRef of a pyarrow.Table
    ledger: Any  # ActorHandle[RunLedger]
    fs: RetryingFileSystem  # the run's storage, with its retry policy (pickles)
    run_path: str  # the run's directory on ``fs``
    run_name: str
    data: dict[
        str, Any
    ]  # the train catalog's fingerprint (ftjob.driver.resume.catalog_fingerprint)
    scratch: str  # this driver's checkpoint scratch (ftjob.worker.checkpointer.scratch_name)
    fence: LeaseFence  # raises once another driver holds the run: before every commit, prune
    public_config: dict[str, Any]  # the resolved config, secrets redacted: kept in checkpoints


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for step-local randomness (dropout...): the same whichever attempt runs the step."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def make_notices(
    job: JobConfig, world: int, device: Any, ledger: Any, rank: int
) -> PreemptionNotices | None:
    """A rank's notice signals: preemptions (failure.preemption), and a planned elastic
    resize, which takes the same path (a checkpoint of the current step, then teardown)."""
    preemption = job.failure.preemption
    if not (preemption or job.trainer.elastic):
        return None
    ledger = ledger if rank == 0 else None  # rank 0 polls the ledger; agree() tells the rest
    return PreemptionNotices(world, device, ledger, sigterm=preemption, drain=preemption)


def backward_in_micro_batches(
    model: Any,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    before_backward: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Gradients of the mean loss over this rank's slice, in micro-batches of at most
    ``batch_size`` (several only below full size: elastic). Each micro-batch's mean loss is
    weighted by its share of the slice, so the accumulated gradient is the slice's mean; a DDP
    model all-reduces once, with the last micro-batch. Returns the slice's mean loss."""
    n = images.shape[0]
    chunks = micro_batches(n, batch_size)
    total = torch.zeros((), device=images.device)
    for lo, hi in chunks:
        local = hi < n and hasattr(model, "no_sync")  # no all-reduce until the last
        with model.no_sync() if local else contextlib.nullcontext():
            loss = loss_of(images[lo:hi], labels[lo:hi])
            if len(chunks) > 1:
                loss = loss * ((hi - lo) / n)
            if lo == 0:  # after DDP's forward sync of buffers, before the gradient all-reduce
                before_backward()
            loss.backward()
        total += loss.detach()
    return total


class Worker:
    """One training worker's attempt. ``run()`` is the whole attempt; checkpoints are the
    :class:`~ftjob.worker.checkpointer.Checkpointer`'s, data order and position the iterator's."""

    def __init__(self, spec: WorkerSpec) -> None:
        entered = time.perf_counter()
        self.spec = spec
        self.job = job = spec.job
        self.trainer = job.trainer
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.fs = spec.fs  # the run's retrying filesystem, as the driver built it
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
        self.lr = LRSchedule.for_trainer(self.trainer, self.plan.steps_per_epoch)
        self.validated_step, self.smoothing = -1, self.trainer.label_smoothing
        self.restore_info: dict[str, Any] | None = None
        self.losses = LossWindow(self.device, self.world)
        self.notices: PreemptionNotices | None = None
        self.validation_cut: int | None = None  # the step whose validation a notice cut short
        # Set-up phases (seconds) until the first step, for the ledger's recovery records.
        self.started: dict[str, float] = {"entered": entered}

    # -- setup ----------------------------------------------------------------------------

    def _register(self) -> None:
        ask = self.ledger.start_attempt
        start = ray.get(ask.remote(time.time(), self.world)) if self.rank == 0 else None
        start = broadcast(start, self.world)
        self.attempt, self.stop_reason = start["attempt"], start["stop"]
        set_fault_stream(self.fs, f"attempt {self.attempt} rank {self.rank}")
        node = ray.get_runtime_context().get_node_id()
        where = {"node_id": node, "pid": os.getpid(), "raylet_pid": os.getppid()}
        self.ledger.register_worker.remote(self.attempt, self.rank, {**where, "time": time.time()})
        interval = self.job.failure.heartbeat_interval
        self.beat = Heartbeat(
            self.ledger, self.attempt, self.rank, self.fs.completed_requests, interval
        )
        self.checkpointer = make_checkpointer(
            self.spec, self.rank, self.world, self.attempt, self.metrics
        )

    def _build(self) -> None:
        torch.manual_seed(self.trainer.seed)
        model = build_model(self.job.model, self.spec.dataset.num_classes)
        if self.trainer.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = ray.train.torch.prepare_model(model)
        self.beat.attach(self.model)
        self.module = self.model.module if hasattr(self.model, "module") else self.model
        groups = parameter_groups(self.module, self.trainer.weight_decay_norm_and_bias)
        self.optimizer = build_optimizer(self.job.optimizer, groups, self.trainer.lr)
        self.autocast = self.trainer.precision == "bf16"

    def _locate(self) -> Restored | None:
        """The checkpoint to restore, downloaded, its state (step, data position) applied."""
        located = self.checkpointer.locate(self.plan.global_batch_size)
        if located is not None:
            self.metrics.load_state_dict(located.metrics)
            self.metrics.add(M.CHECKPOINT_DOWNLOAD, located.download_s)
            self.state = located.state
            self.validated_step = self.state.step if self.state.validated else -1
        return located

    def _validation_owed(self) -> bool:
        """Was the restored step due a validation that did not run to its end?"""
        s, every = self.state, self.trainer.validate_every_n_steps
        due = s.step > 0 and (s.position == 0 or bool(every and s.step % every == 0))
        return self.restore_info is not None and not s.validated and due

    def _checkpoint(self) -> bool:
        """False: the job must stop (a fatal upload failure, or a non-finite loss since the
        last check: diverged weights are never written over a good checkpoint)."""
        if self._diverged(self.losses.peek(self.state.step)):
            return False
        if not all(torch.isfinite(p).all() for p in self.module.parameters()):
            return not self._diverged(math.nan)  # a finite loss, but the step made them NaN
        self.state.validated = self.validated_step == self.state.step
        with self.beat.section("checkpoint"):
            return self.checkpointer.save(
                self.state, self.module, self.optimizer, self.plan.global_batch_size
            )

    # -- validation -----------------------------------------------------------------------

    def _validate(self, epoch: int) -> None:
        if self.validated_step == self.state.step:
            return
        self.validated_step = self.state.step
        stop = self.notices.noticed if self.notices is not None else None
        with self.metrics.timer(M.VALIDATION_STEP), self.beat.section("validation"):
            loss, correct, count, complete = evaluate(
                self.module, self.val_set, self.device, self.autocast, self.world, stop
            )
        if not complete:  # a preemption notice: this step's validation runs after the restore
            self.validated_step, self.validation_cut = -1, self.state.step
            return
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
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.state.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss = backward_in_micro_batches(
            self.model, images, labels, self.trainer.batch_size, self._loss, self.beat.straggle
        )  # chaos=slow sleeps between forward and backward: local time, not the others' wait
        self.optimizer.step()
        return loss

    def _loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return F.cross_entropy(self.model(images), labels, label_smoothing=self.smoothing)

    def _diverged(self, loss: float) -> bool:
        """A non-finite loss stops the job (every rank sees the same all-reduced loss, so all
        stop together), unless trainer.stop_on_nonfinite_loss=false. Retrying would diverge
        again: the job ends as failed, not through the failure budget."""
        if math.isfinite(loss) or not self.trainer.stop_on_nonfinite_loss:
            return False
        if self.rank == 0:
            why = divergence(loss, self.state.step, self.losses.last_finite_step)
            self.ledger.set_fatal.remote(why)
        return True

    def _preempted(self) -> bool:
        """Every rank, once per step: on an agreed preemption notice, commit a checkpoint of
        this very step (0 lost steps), then wait to be torn down -- returning would tell Ray
        Train that training finished. False when there is no notice."""
        if self.notices is None or self.state.step >= self.total_steps:
            return False  # at the last step the run ends anyway
        notice = self.notices.agree()
        if notice is None:
            return False
        if self.rank == 0:
            record = notice.record(self.state.step, self.notices.drain_ranks)
            record = {**record, "validation_cut": self.validation_cut}
            self.ledger.preemption_notice.remote(self.attempt, record)
        self.state.validated = self.validated_step == self.state.step
        with self.beat.section("checkpoint"):
            jit = self.checkpointer.save_now(
                self.state,
                self.module,
                self.optimizer,
                self.plan.global_batch_size,
                notice.deadline,
            )
        self.beat.enter("preempted")
        if self.rank == 0:
            self.ledger.jit_checkpoint.remote(self.attempt, {**jit, "time": time.time()})
        self.checkpointer.send_storage_stats()
        self.notices.wait_for_teardown()  # never returns

    def _log_progress(self) -> bool:
        """A progress line with the mean loss since the last one. False: training diverged."""
        loss, throughput = self.losses.read(self.state.step)
        self.metrics.set(M.TRAIN_LOSS, loss)
        if self.rank == 0:
            self._send_progress(self.state.epoch, loss, throughput)
        return not self._diverged(loss)

    def _send_progress(self, epoch: int, loss: float, throughput: float) -> None:
        progress = {"step": self.state.step, "epoch": epoch, "epochs": self.trainer.epochs}
        progress.update(total_steps=self.total_steps, loss=loss, throughput=throughput)
        progress["lr"] = self.lr(max(self.state.step - 1, 0))  # the last step's
        self.ledger.progress_update.remote(
            self.attempt, {**progress, "time": time.time()}, self.metrics.as_dict()
        )

    def run(self) -> None:
        self._register()
        if self.stop_reason is not None:  # a fatal error or a restart loop: the ledger says why
            return
        self.started["registered"] = time.perf_counter()
        self.notices = make_notices(self.job, self.world, self.device, self.ledger, self.rank)
        self._build()
        self.started["built"] = time.perf_counter()
        self.beat.enter("restore")  # until the stream starts at the restored position
        try:
            located = self._locate()
        except NoUsableCheckpoint as exc:  # every rank: retrying would find the same
            if self.rank == 0:
                self.ledger.set_fatal.remote(str(exc))
            return
        if located is not None:
            self.checkpointer.load(located, self.module, self.optimizer, self.device)
        self.val_set, feeder, skip_s = open_streams(
            self.spec, self.catalogs, self.device, self.plan, self.rank, self.world, self.state
        )
        self.metrics.add(M.TRAIN_ITER_SKIP_BATCH, skip_s)
        try:
            if located is not None:
                self.restore_info = {**located.record(), "skip": skip_s}
                if self.rank == 0:
                    self.ledger.restored.remote(self.attempt, self.restore_info)
            self.checkpointer.send_storage_stats()
            if self._validation_owed():  # a preemption notice cut it short before the checkpoint
                self._validate(
                    self.state.epoch - 1 if self.state.position == 0 else self.state.epoch
                )
            self.beat.enter("warmup")  # until the first step
            if not self._train(feeder):
                return
        except Exception as exc:  # a data error ends the job; anything else is raised again
            end_on_data_error(exc, self.ledger, self.world)
            return
        finally:
            feeder.close()
            self.val_set.close()
        with self.beat.section("checkpoint"):
            if not self.checkpointer.finish(self.state):
                return
        self.checkpointer.send_storage_stats()
        if self.rank == 0:  # the final progress line: the whole run's throughput
            busy = self.metrics.get(M.TRAIN_STEP) + self.metrics.get(M.TRAIN_ITER_BATCH)
            rate = self.metrics.get(M.TRAIN_ROWS_PROCESSED) / max(busy, 1e-9)
            self._send_progress(self.state.epoch - 1, self.metrics.get(M.TRAIN_LOSS), rate)
            self.ledger.finish.remote(time.time())

    def _train(self, feeder: BatchFeeder) -> bool:
        """Train to the end; False if the job must stop (a fatal upload failure, divergence)."""
        t, B = self.trainer, self.plan.global_batch_size
        first_step_done, new_epoch = False, True
        wait_start = time.perf_counter()
        for epoch, batch in feeder:
            waited = time.perf_counter() - wait_start
            if batch is EPOCH_END:
                # Epoch end: position wraps to the next epoch before the checkpoint is written.
                self.state.epoch, self.state.position = epoch + 1, 0
                self._validate(epoch)
                if not self._checkpoint():
                    return False
                self._preempted()
                new_epoch = True
                wait_start = time.perf_counter()
                continue
            self.metrics.add(M.TRAIN_ITER_FIRST_BATCH if new_epoch else M.TRAIN_ITER_BATCH, waited)
            new_epoch = False
            self.beat.step_started(waited)
            with self.metrics.timer(M.TRAIN_STEP):
                self.losses.add(self._train_step(batch.images, batch.labels), B)
            self.state.step += 1
            self.beat.step_done(self.state.step)
            self.state.position += B
            self.metrics.add(M.TRAIN_ROWS_PROCESSED, B)
            self.metrics.set(M.TRAIN_STEPS_COMPLETED, self.state.step)
            if t.audit_samples:
                self.ledger.audit_step.remote(
                    self.attempt, self.state.step, epoch, batch.ids.tolist()
                )
            if self.rank == 0:
                self.ledger.step_done.remote(self.attempt, self.state.step)
                if not first_step_done:  # with its own cost (batch wait + step): not set-up
                    took = time.perf_counter() - wait_start
                    self.ledger.first_step.remote(
                        self.attempt,
                        self.state.step,
                        time.time(),
                        took,
                        start_phases(self.started, waited, took),
                    )
            if not first_step_done:
                # Training is flowing: decode the validation set into its cache meanwhile.
                self.val_set.prefetch()
            first_step_done = True
            if self.rank == 0:
                maybe_inject_failure(self.ledger, self.state.step, self.job.chaos.fail_at_steps)
            if self.state.step % t.log_every_n_steps == 0 and not self._log_progress():
                return False
            # The epoch's last step validates and checkpoints at EPOCH_END.
            if self.state.position < self.plan.samples_per_epoch:
                if t.validate_every_n_steps and self.state.step % t.validate_every_n_steps == 0:
                    self._validate(epoch)
                if self.checkpointer.schedule.due(self.state.step):
                    if not self._checkpoint():
                        return False
                self._preempted()
            wait_start = time.perf_counter()
        return True


def train_loop(spec: WorkerSpec) -> None:
    """Entry point handed to TorchTrainer (train_loop_config is the WorkerSpec)."""
    worker = Worker(spec)
    try:
        worker.run()
    finally:
        if worker.notices is not None:  # SIGTERM is Ray's again
            worker.notices.close()
        if hasattr(worker, "beat"):
            worker.beat.close()
        if hasattr(worker, "checkpointer"):
            worker.checkpointer.close()
