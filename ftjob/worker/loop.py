"""The training worker: what Ray Train runs on every worker, and runs again from the newest
valid checkpoint after a failure. :meth:`Worker.train` is one attempt and reads top to bottom:

    start (the attempt's index, heartbeat, checkpointer) -> build (model, optimizer, notices)
    -> restore (timed: download, load) -> open the streams at the restored position (timed:
    skip) -> for each batch: step, then after the step: progress, validation, checkpoint
    (when due: the checkpointer decides), preemption notices -> finish (the final checkpoint)

Everything it needs from the world comes from its :class:`~ftjob.worker.context.WorkerContext`
(Ray Train in production, this process in tests) and every record goes through its
:class:`~ftjob.worker.recorder.RunRecorder`. A job that must stop (divergence, the upload
budget spent, no checkpoint that verifies, the run taken over) raises
:class:`~ftjob.worker.recorder.JobStopped` on every rank together; the attempt then returns,
and the driver reports the ledger's reason. A file that cannot be decoded is recorded as the
run's fatal error by the rank that met it (:func:`end_on_data_error`): with one worker the
attempt returns, with several it fails, so that Ray Train ends the group, and the restart stops
at its start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftjob import metrics as M
from ftjob.actors import Actor
from ftjob.config import JobConfig, to_plain
from ftjob.config.secrets import Redactor, guard_logging
from ftjob.data.clock import DataClock
from ftjob.data.datasets import TRAIN, VAL, ImageDataset, data_error_of, epoch_plan
from ftjob.data.decode_place import (
    PROBE_ROWS,
    auto_places,
    fastest,
    on_device,
    probe,
    probe_line,
    ray_cores,
)
from ftjob.data.order import EpochPlan, validation_ids
from ftjob.data.streams import (
    EPOCH_END,
    Batch,
    BatchFeeder,
    DecodedStream,
    DeviceStream,
    InProcessStream,
    RayDataStream,
    ResumableIterator,
    SkipLog,
    ValidationSet,
    decode_threads,
    numpy_rows,
)
from ftjob.memory.node_holders import holders_for
from ftjob.memory.tier import MemoryTier
from ftjob.policy.cadence import CheckpointSchedule
from ftjob.record import DecodeChoice, Progress, WorkerLedger
from ftjob.storage.faults import set_fault_stream
from ftjob.storage.fs import RetryingFileSystem
from ftjob.storage.lease import LeaseFence
from ftjob.worker.backward import Backward, data_parallel
from ftjob.worker.checkpointer import Checkpointer, NoUsableCheckpoint, Restored, TrainState
from ftjob.worker.context import WorkerContext, ray_context
from ftjob.worker.device_memory import epoch_ended
from ftjob.worker.exact import pin_kernels, refused_op
from ftjob.worker.heartbeat import Heartbeat
from ftjob.worker.models import build_model
from ftjob.worker.optim import LRSchedule, build_optimizer, parameter_groups
from ftjob.worker.preemption import PreemptionNotices
from ftjob.worker.recorder import JobStopped, RunRecorder
from ftjob.worker.scratch import attempt_scratch_dir
from ftjob.worker.validation import Validator


@dataclass
class WorkerSpec:
    """What the driver hands every worker: plain, resolved data and handles."""

    job: JobConfig
    dataset: ImageDataset
    catalogs: dict[str, Any]  # split -> pyarrow.Table (an ObjectRef of one, on Ray)
    ledger: Actor[WorkerLedger]  # the run ledger's handle (a Ray actor in production)
    fs: RetryingFileSystem  # the run's storage, with its retry policy (pickles)
    run_path: str  # the run's directory on ``fs``
    run_name: str
    data: dict[str, Any]  # the train catalog's fingerprint (ftjob.driver.resume)
    scratch: str  # this driver's checkpoint scratch (ftjob.worker.scratch.scratch_name)
    fence: LeaseFence  # raises once another driver holds the run: before every commit, prune
    public_config: dict[str, Any]  # the resolved config, secrets redacted: kept in checkpoints
    memory: Any = None  # the memory tier's holders (checkpoint.memory), if on


def train_loop(spec: WorkerSpec, config: dict[str, Any] | None = None) -> None:
    """Entry point handed to TorchTrainer as ``functools.partial(train_loop, spec)``. Its
    ``train_loop_config`` (``config``) is the job's config with secrets redacted, for what
    Ray shows of the run (its dashboard's Train view, Ray Train's state export); the spec
    travels with the function, never into that view."""
    guard_worker_logging(spec.job)
    Worker(spec, ray_context(spec.ledger)).train()


def guard_worker_logging(job: JobConfig) -> None:
    """This worker process's log records lose the job's secrets (storage options, the
    workers' environment) and any URL's password: they reach Ray's log files and, streamed,
    the driver's console, which the driver's own guard never sees."""
    guard_logging(Redactor(resolved=to_plain(job)))


class InjectedFailure(RuntimeError):
    """Raised at a step listed in chaos.fail_at_steps (once per run)."""


class Worker:
    """One training worker's attempt. Checkpoints are the :class:`Checkpointer`'s, data order
    and position the iterator's; everything else is here, built in :meth:`_start`/:meth:`_build`."""

    spec: WorkerSpec
    ctx: WorkerContext
    job: JobConfig
    trainer: Any  # job.trainer
    autocast: bool  # bf16 autocast (trainer.precision)
    record: RunRecorder  # every ledger call, with its rank rule
    rank: int
    world: int
    catalogs: dict[str, Any]  # split -> pyarrow.Table
    plan: EpochPlan  # the data order (global batch, steps per epoch)
    total_steps: int
    state: TrainState  # where training stands
    metrics: M.MetricSet
    lr: LRSchedule
    losses: LossWindow  # the training loss since the last progress line
    beat: Heartbeat
    checkpointer: Checkpointer
    memory: MemoryTier  # checkpoint.memory: snapshots (the checkpointer's), settled at each step
    notices: PreemptionNotices | None  # preemptions, and planned elastic resizes
    model: Any  # as prepared for data parallelism (DDP; the bare model in exact mode)
    backward: Backward  # the step's gradients: DDP's, or exact mode's (trainer.exact)
    module: torch.nn.Module  # the model itself
    optimizer: torch.optim.Optimizer
    restored: Restored | None
    val_set: ValidationSet | None
    validator: Validator  # validation of a step, once; owed after a notice cut it short
    feeder: BatchFeeder | None
    started: dict[str, float]  # perf_counter stamps of the attempt's set-up
    first_step_done: bool
    _wait_start: float  # when this rank began waiting for its next batch

    def __init__(self, spec: WorkerSpec, ctx: WorkerContext) -> None:
        self.started = {"entered": time.perf_counter()}
        self.entered = time.time()  # the attempt's start, as the run ledger records it
        self.spec = spec
        self.ctx = ctx
        self.job = spec.job
        self.trainer = spec.job.trainer
        self.record = ctx.recorder
        self.rank = ctx.rank
        self.world = ctx.world
        self.catalogs = {split: ctx.fetch(ref) for split, ref in spec.catalogs.items()}
        self.plan = epoch_plan(spec.dataset, self.catalogs[TRAIN], self.trainer)
        self.total_steps = self.plan.steps_per_epoch * self.trainer.epochs
        self.state = TrainState()
        self.metrics = M.MetricSet()
        self.lr = LRSchedule.for_trainer(self.trainer, self.plan.steps_per_epoch)
        self.losses = LossWindow(ctx.device, self.world)
        self.notices = self.restored = self.val_set = self.feeder = None
        self.first_step_done = False
        self._wait_start = time.perf_counter()
        self.beat = self.checkpointer = self.validator = None  # type: ignore[assignment]  # set in _start

    # -- the attempt, top to bottom --------------------------------------------------------

    def train(self) -> None:
        """The whole attempt. One exit: a job that must stop ends it as a normal return, and
        whatever the attempt opened is closed whichever way it ends."""
        try:
            self._start()
            self._build()
            self._restore()
            assert self.feeder is not None
            for epoch, batch in self.feeder:
                epoch_end = batch is EPOCH_END
                if not epoch_end:
                    self._step(epoch, batch)
                self._after_step(epoch, epoch_end)
            self._finish()
        except JobStopped:
            pass  # every rank together; the ledger has the reason
        except Exception as exc:  # a file that cannot be decoded; anything else is raised again
            end_on_data_error(exc, self.record, self.world)
        finally:
            self._close()

    def _start(self) -> None:
        """The attempt's index (rank 0 asks, every rank hears), where this rank runs, its
        heartbeat and checkpointer. A fatal error or a restart loop stops it here."""
        answer = self.ctx.broadcast(self.record.start_attempt(self.world, self.entered))
        self.record.attempt = answer.attempt
        if answer.stop is not None:
            raise JobStopped(answer.stop)
        pin_kernels(self.trainer, self.ctx.device)
        set_fault_stream(self.spec.fs, f"attempt {self.record.attempt} rank {self.rank}")
        self.record.register(self.ctx.where)
        hang = self.job.failure.hang
        self.beat = Heartbeat(
            self.record,
            self.spec.fs.completed_requests,
            hang.heartbeat_interval,
            settle_steps=hang.settle_steps,
        )
        self.checkpointer = self._checkpointer()
        self.started["registered"] = time.perf_counter()

    def _checkpointer(self) -> Checkpointer:
        """This rank's checkpointer: its cadence, its storage and scratch, the memory tier."""
        job, spec = self.job, self.spec
        self.memory = MemoryTier(
            holders_for(spec.memory, self.ctx, spec.fence.generation),  # writes carry it
            job.checkpoint.memory,
            self.rank,
            self.metrics,
            self.ctx.fetch,
            self.record.log,
        )
        every = self.trainer.checkpoint_every_n_steps
        return Checkpointer(
            fs=spec.fs,
            run_path=spec.run_path,
            config=job.checkpoint,
            job_config=spec.public_config,
            recorder=self.record,
            world=self.world,
            broadcast=self.ctx.broadcast,
            report=self.ctx.report,
            metrics=self.metrics,
            local_root=attempt_scratch_dir(spec.scratch, self.record.attempt, self.rank),
            global_batch=self.plan.global_batch_size,
            data=spec.data,
            schedule=CheckpointSchedule(every, job.failure.expected_mtbf_s),
            fence=spec.fence,
            memory=self.memory,  # checkpoint.memory
        )

    def _build(self) -> None:
        """Notices, model (the same initial weights on every rank), DDP, optimizer."""
        job, t = self.job, self.trainer
        if job.failure.preemption or t.elastic:  # a planned resize takes the notice's path
            self.notices = PreemptionNotices(
                self.world,
                self.ctx.device,
                self.record if self.rank == 0 else None,  # rank 0 polls; agree() tells the rest
                sigterm=job.failure.preemption and self.ctx.ray_signals,
                drain_notice=self.ctx.drain_notice if job.failure.preemption else None,
            )
        torch.manual_seed(t.seed)
        model = build_model(job.model, self.spec.dataset.num_classes)
        if t.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model, self.backward = data_parallel(model, t, self.ctx, self.beat.gradients_ready)
        self.beat.attach(self.model)
        self.module = self.model.module if hasattr(self.model, "module") else self.model
        groups = parameter_groups(self.module, t.weight_decay_norm_and_bias)
        self.optimizer = build_optimizer(job.optimizer, groups, t.lr)
        self.autocast = t.precision == "bf16"
        self.started["built"] = time.perf_counter()

    def _restore(self) -> None:
        """The newest checkpoint that verifies, loaded (or step 0); the streams opened at its
        position -- nothing before it is read -- and the restore recorded."""
        self.beat.enter("restore")  # until the stream starts at the restored position
        try:
            self.restored = self.checkpointer.restore(self.module, self.optimizer, self.ctx.device)
        except NoUsableCheckpoint as exc:  # every rank: retrying would find the same
            raise self.record.fatal(str(exc)) from None
        if self.restored is not None:
            saved = self.restored.state
            self.state = TrainState(saved.step, saved.epoch, saved.position, saved.validated)
        s = self.state
        self.val_set, self.feeder, skip_s = open_streams(
            self.spec.dataset, self.catalogs, self.trainer, self.ctx, self.plan, s, self.metrics
        )
        stop = self.notices.noticed if self.notices is not None else None
        self.validator = Validator(
            self.val_set, self.ctx, self.autocast, self.metrics, self.beat.section, stop
        )
        self.metrics.add(M.TRAIN_ITER_SKIP_BATCH, skip_s)
        if self.restored is not None:
            self.record.restored(self.restored.record(skip_s))
            self.validator.restored(s.step, s.validated)
            every = self.trainer.validate_every_n_steps
            if Validator.owed(s.step, s.position, s.validated, every):  # a notice cut it short
                self.validator.run(self.module, s.step, s.epoch - 1 if s.position == 0 else s.epoch)
        self.checkpointer.send_storage_stats()
        self.beat.enter("warmup")  # until the first step
        self._wait_start = time.perf_counter()

    def _step(self, epoch: int, batch: Batch) -> None:
        """One training step on this rank's slice of the global batch, and its records."""
        t, B = self.trainer, self.plan.global_batch_size
        waited = time.perf_counter() - self._wait_start
        first = not self.first_step_done
        new_epoch = first or self.state.position == 0
        self.metrics.add(M.TRAIN_ITER_FIRST_BATCH if new_epoch else M.TRAIN_ITER_BATCH, waited)
        self.beat.step_started(waited)
        audited = _audit(self.record, t.audit_samples, self.state.step + 1, epoch, batch)
        with self.metrics.timer(M.TRAIN_STEP):
            self.losses.add(self._train_step(batch, audited), B)
        self.state.step += 1
        self.beat.step_done(self.state.step)
        self.state.position += B
        self.metrics.add(M.TRAIN_ROWS_PROCESSED, B)
        self.metrics.set(M.TRAIN_STEPS_COMPLETED, self.state.step)
        self.record.step_done(self.state.step)
        if first:  # with its own cost (batch wait + step): not set-up
            self.first_step_done = True
            took = time.perf_counter() - self._wait_start
            self.record.first_step(self.state.step, took, start_phases(self.started, waited, took))
            assert self.val_set is not None
            self.val_set.prefetch()  # training is flowing: fill the validation cache meanwhile
        step = self.state.step
        if step in self.job.chaos.fail_at_steps and self.record.claim_injected_failure(step):
            raise InjectedFailure(f"chaos.fail_at_steps: injected failure at step {step}")

    def _after_step(self, epoch: int, epoch_end: bool) -> None:
        """After every step, and at the end of every epoch (the epoch's last step acts there,
        with the position already wrapped to the next epoch): progress line, validation,
        checkpoint when due, preemption notice."""
        s, t = self.state, self.trainer
        if epoch_end:
            s.epoch, s.position = epoch + 1, 0
            epoch_ended(self.ctx.device, self.metrics)  # the GPU's peak of the epoch
        else:
            if s.step % t.log_every_n_steps == 0:
                self._log_progress()
            if s.position >= self.plan.samples_per_epoch:
                return  # the epoch's last step: validated and checkpointed at its end
        if epoch_end or (t.validate_every_n_steps and s.step % t.validate_every_n_steps == 0):
            self.validator.run(self.module, s.step, epoch)
        s.validated = self.validator.done(s.step)
        self.checkpointer.maybe_save(
            s,
            self.module,
            self.optimizer,
            epoch_end,
            guard=self._refuse_diverged,
            section=self.beat.section,
        )
        self._preempted()
        self._wait_start = time.perf_counter()

    def _finish(self) -> None:
        """The final checkpoint must commit; the run's last progress line."""
        with self.beat.section("checkpoint"):
            self.checkpointer.finish(self.state)
        self.checkpointer.send_storage_stats()
        self._send_progress(self.state.epoch - 1, *self.losses.final(self.state.step, self.metrics))
        self.record.finish()

    def _close(self) -> None:
        for closing in (self.feeder, self.val_set, self.notices, self.beat, self.checkpointer):
            if closing is not None:
                closing.close()

    # -- parts of a step ---------------------------------------------------------------------

    def _train_step(self, batch: Batch, audited: Callable[[], None] | None) -> torch.Tensor:
        torch.manual_seed(_step_seed(self.trainer.seed, self.state.step, self.rank))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.state.step)
        self.optimizer.zero_grad(set_to_none=True)
        hook = _before_backward(audited, self.beat.straggle)
        loss = self.backward(self.state.step, self.model, batch, self._loss, hook)
        self.memory.settle()  # a snapshot still copying what the optimizer changes ends first
        self.optimizer.step()
        return loss

    def _loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return F.cross_entropy(
                self.model(images), labels, label_smoothing=self.trainer.label_smoothing
            )

    def _refuse_diverged(self) -> None:
        """Before a checkpoint: a non-finite loss since the last check, or non-finite weights
        (a finite loss, but the step made them NaN), stop the job -- diverged weights are
        never written over a good checkpoint."""
        self._stop_if_diverged(self.losses.peek(self.state.step))
        if not all(torch.isfinite(p).all() for p in self.module.parameters()):
            self._stop_if_diverged(math.nan)

    def _stop_if_diverged(self, loss: float) -> None:
        """A non-finite loss stops the job (every rank sees the same all-reduced loss, so all
        stop together), unless trainer.stop_on_nonfinite_loss=false. Retrying would diverge
        again: the job ends as failed, not through the failure budget."""
        if math.isfinite(loss) or not self.trainer.stop_on_nonfinite_loss:
            return
        raise self.record.fatal(divergence(loss, self.state.step, self.losses.last_finite_step))

    def _preempted(self) -> None:
        """Every rank, once per step: on an agreed preemption notice, commit a checkpoint of
        this very step (0 lost steps), then be torn down (the context's teardown: returning
        would tell Ray Train that training finished)."""
        if self.notices is None or self.state.step >= self.total_steps:
            return  # at the last step the run ends anyway
        notice = self.notices.agree()
        if notice is None:
            return
        record = notice.record(self.state.step, self.notices.drain_ranks, self.validator.cut)
        self.record.preemption_notice(record)
        self.state.validated = self.validator.done(self.state.step)
        with self.beat.section("checkpoint"):
            jit = self.checkpointer.save_now(
                self.state, self.module, self.optimizer, notice.deadline
            )
        self.beat.enter("preempted")
        self.record.jit_checkpoint(jit)
        self.checkpointer.send_storage_stats()
        self.notices.wait_for_teardown(self.ctx.teardown)

    def _log_progress(self) -> None:
        """A progress line with the mean loss since the last one; a non-finite one stops."""
        loss, throughput = self.losses.read(self.state.step)
        self.metrics.set(M.TRAIN_LOSS, loss)
        self._send_progress(self.state.epoch, loss, throughput)
        self._stop_if_diverged(loss)

    def _send_progress(self, epoch: int, loss: float, throughput: float) -> None:
        progress = Progress(
            step=self.state.step,
            epoch=epoch,
            epochs=self.trainer.epochs,
            total_steps=self.total_steps,
            loss=loss,
            throughput=throughput,
            lr=self.lr(max(self.state.step - 1, 0)),  # the last step's
        )
        self.record.progress(progress, self.metrics.as_dict())


# -- the pieces, pure or nearly ---------------------------------------------------------------


def _audit(
    record: RunRecorder, on: bool, step: int, epoch: int, batch: Batch
) -> Callable[[], None] | None:
    """With ``trainer.audit_samples`` (``on``), this rank's slice of ``step`` sent to the
    audit as the step starts: the wait until the ledger holds it
    (:meth:`RunRecorder.audit_step`); None without."""
    if not on:
        return None
    return record.audit_step(step, epoch, batch.ids.tolist(), batch.skipped_ids())


def _before_backward(
    audited: Callable[[], None] | None, straggle: Callable[[], None]
) -> Callable[[], None]:
    """What runs between a step's first forward pass and its backward: the wait until the
    ledger holds this rank's audit slice (before the gradients' all-reduce), then chaos=slow's
    sleep (this rank's local time, not the others' wait)."""

    def hook() -> None:
        if audited is not None:
            audited()
        straggle()

    return hook


def decode_place(
    dataset: ImageDataset,
    catalogs: dict[str, Any],
    trainer: Any,
    ctx: WorkerContext,
    plan: EpochPlan,
    state: TrainState,
    metrics: M.MetricSet,
) -> str:
    """Where every rank decodes its batches -- ``worker``, ``ray`` or ``device`` -- chosen by
    rank 0 (:func:`_choose_place`), heard by every rank, kept in the metrics (every
    checkpoint's) and said once for the run."""
    chosen = ctx.broadcast(
        _choose_place(dataset, catalogs, trainer, ctx, plan, state, metrics)
        if ctx.rank == 0
        else None
    )
    metrics.set(M.DATA_DECODE_PLACE, M.DECODE_PLACES[chosen.place])
    for place, rate in chosen.rates.items():
        metrics.set(M.DATA_PROBE + place, rate)
    if ctx.rank == 0:
        where = {"worker": "in the training processes", "ray": "in Ray Data"}
        place = where.get(chosen.place, "on the training device")
        ctx.recorder.log(f"data: rank 0 decodes {place} ({chosen.reason})")
    return str(chosen.place)


def _choose_place(
    dataset: ImageDataset,
    catalogs: dict[str, Any],
    trainer: Any,
    ctx: WorkerContext,
    plan: EpochPlan,
    state: TrainState,
    metrics: M.MetricSet,
) -> DecodeChoice:
    """Rank 0: ``trainer.decode_in`` as set (in this process where there is no Ray: the
    context's ``decode_here``), or ``auto``'s place -- the run's, where it has one (this
    driver's ledger, or the restored checkpoint's metrics), else the one place there is, else
    the fastest by :func:`~ftjob.data.decode_place.probe` on this rank's first batch."""
    setting = str(trainer.decode_in)
    if setting != "auto" or ctx.decode_here:
        place = "worker" if ctx.decode_here and setting != "device" else setting
        why = f"trainer.decode_in={setting}" + (", a worker without Ray" if ctx.decode_here else "")
        if place == "device" and not on_device(dataset):
            place, why = "worker", f"{why}: {dataset.describe()} has no images to decode there"
        chosen = DecodeChoice(place, why)
        return ctx.recorder.decode_choice(chosen) or chosen
    code = int(metrics.get(M.DATA_DECODE_PLACE))
    kept = {v: k for k, v in M.DECODE_PLACES.items()}.get(code)
    run = ctx.recorder.decode_choice(DecodeChoice(kept, "the run's, kept") if kept else None)
    if run is not None:
        return run
    cores, one_machine = ctx.machine()
    cuda = torch.device(ctx.device).type == "cuda"
    w, cpus = trainer.worker_cpus, trainer.decode_cpus
    places, why = auto_places(
        trainer.use_gpu, cuda, dataset, cores, ctx.local_world, w, cpus, one_machine
    )
    rates = _probe(dataset, catalogs, trainer, ctx, plan, state, places) if len(places) > 1 else {}
    if rates:
        why = probe_line(fastest(rates, places), rates)
    chosen = DecodeChoice(fastest(rates, places) if rates else places[0], why, rates)
    return ctx.recorder.decode_choice(chosen) or chosen


def _probe(
    dataset: ImageDataset,
    catalogs: dict[str, Any],
    trainer: Any,
    ctx: WorkerContext,
    plan: EpochPlan,
    state: TrainState,
    places: list[str],
) -> dict[str, float]:
    """Images/s of each of ``places`` on the first batch this rank trains next."""
    ids = plan.shard(state.epoch, state.position, ctx.rank, ctx.world)
    ids = ids[: min(plan.global_batch_size // ctx.world, PROBE_ROWS)]
    if not len(ids):
        return {}
    cores, one_machine = ctx.machine()
    w = trainer.worker_cpus
    return probe(
        dataset,
        numpy_rows(catalogs[TRAIN].take(pa.array(ids))),
        places,
        seed=trainer.seed,
        device=ctx.device,
        threads=decode_threads(trainer.use_gpu, w),
        ray_share_cores=ray_cores(cores, ctx.local_world, w, one_machine),
        epoch=state.epoch,
    )


def open_streams(
    dataset: ImageDataset,
    catalogs: dict[str, Any],
    trainer: Any,
    ctx: WorkerContext,
    plan: EpochPlan,
    state: TrainState,
    metrics: M.MetricSet | None = None,
) -> tuple[ValidationSet, BatchFeeder, float]:
    """This rank's validation set, and its training batches from ``state``'s position to the
    end of training, already decoding where :func:`decode_place` says (Ray Data, this
    process, the device); and how long positioning took (the skip). Rank 0 says what the user
    should know (where the batches are decoded and why; a validation set too big to cache).
    Files skipped as bad (dataset.bad_files=skip) are named to the run ledger by the rank that
    meets them. The input path's timers go to ``metrics``."""
    device, rank, world = ctx.device, ctx.rank, ctx.world
    metrics = metrics if metrics is not None else M.MetricSet()
    place = decode_place(dataset, catalogs, trainer, ctx, plan, state, metrics)
    common = {
        "seed": trainer.seed,
        "device": device,
        "prefetch_batches": trainer.prefetch_batches,
        "window_mb": trainer.decode_window_mb,
        "pin_memory": device.type == "cuda",
        "channels_last": trainer.channels_last,
        "on_skip": SkipLog(dataset, catalogs, ctx.recorder.skipped_files),
        "clock": DataClock(metrics),
    }
    streams: dict[str, type[DecodedStream]] = {"worker": InProcessStream, "device": DeviceStream}
    train_stream: DecodedStream
    if place in streams:
        common["threads"] = decode_threads(trainer.use_gpu, trainer.worker_cpus)
        train_stream = streams[place](dataset, catalogs[TRAIN], TRAIN, **common)
        val_stream = streams[place](dataset, catalogs[VAL], VAL, **common)
    else:
        common["decode_cpus"] = trainer.decode_cpus
        train_stream = RayDataStream(
            dataset, catalogs[TRAIN], TRAIN, local_first_window=True, **common
        )
        val_stream = RayDataStream(dataset, catalogs[VAL], VAL, **common)
    val_set = ValidationSet(
        val_stream,
        validation_ids(catalogs[VAL].num_rows, rank, world),
        trainer.val_batch_size or trainer.batch_size,
        trainer.validation_cache_mb * 2**20,
        ctx.recorder.log if rank == 0 else None,  # one line for the run, not per rank
    )
    iterator = ResumableIterator(train_stream, plan, rank, world)
    start = time.perf_counter()
    s = state
    first = iterator.epoch(s.epoch, s.position) if s.epoch < trainer.epochs else iter(())
    feeder = BatchFeeder(
        iterator,
        first,
        s.epoch,
        trainer.epochs,
        depth=max(1, trainer.prefetch_batches),
        first_steps=plan.steps_per_epoch - s.position // plan.global_batch_size,
        steps_per_epoch=plan.steps_per_epoch,
    )
    return val_set, feeder, time.perf_counter() - start


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


class LossWindow:
    """The training loss since the last progress line, summed on the device: read back (the
    one host sync) and all-reduced across ranks only at a progress line or a checkpoint."""

    def __init__(self, device: torch.device, world: int) -> None:
        self.device = device
        self.world = world
        self.last_finite_step = 0
        self._reset()

    def _reset(self) -> None:
        self.total = torch.zeros((), device=self.device)
        self.steps = 0
        self.rows = 0
        self.started = time.perf_counter()

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

    def final(self, step: int, metrics: M.MetricSet) -> tuple[float, float]:
        """The run's last progress line: its loss, set as ``train/loss`` (summary.json's) --
        the mean of the steps since the line before it, not that line's loss again, or that
        line's where it was at the last step --, and this rank's images/s over the attempt.
        Every rank has the same steps: the all-reduce of :meth:`peek` is everyone's or no
        one's."""
        if self.steps:
            metrics.set(M.TRAIN_LOSS, self.read(step)[0])
        busy = metrics.get(M.TRAIN_STEP) + metrics.get(M.TRAIN_ITER_BATCH)
        return metrics.get(M.TRAIN_LOSS), metrics.get(M.TRAIN_ROWS_PROCESSED) / max(busy, 1e-9)


def end_on_data_error(exc: Exception, record: RunRecorder, world: int) -> None:
    """A file that cannot be decoded, or an op exact mode cannot run deterministically, fails
    again on every attempt: it is the run's fatal error, not a failure for
    failure.max_failures to absorb. Any other error is raised again (a failure: Ray Train's
    to retry)."""
    refused = refused_op(exc)
    error: Exception | None = RuntimeError(refused) if refused else data_error_of(exc)
    if error is None:
        raise exc
    record.data_error(str(error))
    if world > 1:
        # The ranks whose slices hold no bad file wait in a collective with this one (gloo
        # waits while this process lives): the attempt fails instead, Ray Train ends the
        # group at once, and its restart stops at its start (the ledger has the error).
        raise error from exc


def divergence(loss: float, step: int, last_finite_step: int) -> str:
    return (
        f"training diverged: the loss became non-finite ({loss}) by step {step} (last finite "
        f"at step {last_finite_step}); not retried, and no checkpoint of the diverged weights "
        "was written (trainer.stop_on_nonfinite_loss=false trains on)"
    )


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for step-local randomness (dropout...): the same whichever attempt runs the step."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
