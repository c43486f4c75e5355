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
one that does not; one of a newer format stops the job) and broadcasts the choice; every rank
downloads and loads it (timed: download, load).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ftjob import metrics as M
from ftjob.config import CheckpointConfig
from ftjob.memory.node_holders import unpack_state
from ftjob.memory.tier import MemoryTier
from ftjob.policy.cadence import CheckpointSchedule
from ftjob.record import CheckpointRecord, Fallback, Holder, JitCheckpoint, Restore, Tier
from ftjob.storage.checkpoint import CheckpointStore, NewerFormat, RestoreChoice
from ftjob.storage.lease import LeaseLost
from ftjob.worker.recorder import JobStopped, RunRecorder
from ftjob.worker.uploads import (
    CONFIG_FILE,
    AsyncUploader,
    UploadOutcome,
    prune_quietly,
    upload_checkpoint,
    write_local_checkpoint,
)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"


@dataclass
class TrainState:
    """Where training stands -- the next step trains global batch ``position // B`` of
    ``epoch`` -- and, as a checkpoint keeps it (``state.json``, :meth:`to_json` /
    :meth:`from_json`), what resuming needs to check and restore."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    validated: bool = True  # the validation due at ``step`` ran to its end
    global_batch_size: int = 0
    world_size: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)  # the metric timers and values
    data: dict[str, Any] = field(default_factory=dict)  # the train catalog's fingerprint
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> TrainState:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in known})


@dataclass
class Restored:
    """The checkpoint a worker restored, and how long each part took."""

    state: TrainState
    path: str
    download_s: float
    load_s: float
    skipped: list[dict[str, Any]] = field(default_factory=list)
    tier: str = "storage"  # or "memory": a snapshot of the memory tier
    holder: Holder = Holder.storage  # local | peer: the holder a snapshot came from

    @classmethod
    def of(
        cls, state: TrainState, chosen: RestoreChoice, took: float, memory: MemoryTier | None
    ) -> Restored:
        """What ``chosen`` restored (``took``: the seconds until its files were here)."""
        held = memory.source if memory is not None and chosen.tier == "memory" else None
        return cls(
            state,
            chosen.path,
            took,
            0.0,
            list(chosen.set_aside),
            chosen.tier,
            held or Holder.storage,
        )

    def record(self, skip_s: float) -> Restore:
        """The ledger's restore record (``skip_s``: moving the data iterator there)."""
        return Restore(
            step=self.state.step,
            epoch=self.state.epoch,
            position=self.state.position,
            path=self.path,
            download=self.download_s,
            load=self.load_s,
            skip=skip_s,
            skipped=tuple(Fallback.from_json(bad) for bad in self.skipped),
            tier=Tier(self.tier),
            holder=self.holder,
        )


class NoUsableCheckpoint(RuntimeError):
    """Committed checkpoints exist but none verifies; the job stops instead of starting over."""


def choose_checkpoint(
    store: CheckpointStore, local_root: str, config: Any
) -> RestoreChoice | str | None:
    """Rank 0: the checkpoint to restore, None to start from step 0, or the error that stops
    the job. Whatever does not verify is quarantined on the way
    (:meth:`~ftjob.storage.checkpoint.CheckpointStore.set_aside`); a newest checkpoint of a
    newer format is the error, and nothing is set aside."""
    skipped: list[dict[str, Any]] = []
    try:
        result = store.restore_latest(local_root, skipped)
        store.set_aside(skipped)
    except (LeaseLost, NewerFormat) as exc:  # a deposed driver's workers touch nothing
        return str(exc)
    if result is not None:
        return RestoreChoice(result.step, result.path, "storage", result.local_dir, tuple(skipped))
    lost = [bad for bad in skipped if bad["committed"]]
    if not lost or config.restart_if_unrecoverable:
        return None
    details = "; ".join(f"step {b['step']}: {b['reason']}" for b in lost)
    where = sorted({b.get("quarantined_to", b["path"]).rsplit("/", 1)[0] for b in lost})
    return (
        f"no committed checkpoint of this run verifies ({details}); nothing was deleted: "
        f"they are in {', '.join(where)}. Inspect them, or set "
        "checkpoint.restart_if_unrecoverable=true to start over from step 0"
    )


def choose_restore(
    store: CheckpointStore, memory: MemoryTier | None, local_root: str, config: Any
) -> RestoreChoice | str | None:
    """Rank 0: a memory snapshot newer than every committed checkpoint, else
    :func:`choose_checkpoint`'s choice; the error that stops the job when the newest
    checkpoint is of a newer format (no snapshot is newer than what this ftjob cannot read)."""
    try:
        chosen = memory.offer(store.newest_verified) if memory is not None else None
    except NewerFormat as exc:
        return str(exc)
    return chosen or choose_checkpoint(store, local_root, config)


def prune(store: CheckpointStore, keep: int, say: Callable[[str], None]) -> None:
    """Retention after a commit (:func:`~ftjob.worker.uploads.prune_quietly`); what it moved
    aside as left behind by this generation -- a deposed driver's late commit -- is said."""
    prune_quietly(store, keep)
    for aside in store.moved_aside:
        where = aside.get("quarantined_to") or f"left in place: {aside.get('left')}"
        say(f"checkpoint {aside['path']}: {aside['reason']} ({where})")


def load_state(state_of: Callable[[str], Any], module: Any, optimizer: Any) -> None:
    """Load a checkpoint's model and optimizer state (``state_of(file name)``: its state dict)."""
    for target, name in ((module, MODEL_FILE), (optimizer, OPTIMIZER_FILE)):
        target.load_state_dict(state_of(name))


def snapshot_state(files: dict[str, Any], device: Any) -> Callable[[str], Any]:
    """A memory snapshot's state dicts (:func:`~ftjob.memory.node_holders.unpack_state`): the
    model's as views of its buffer (a module copies what it loads into its parameters), the
    optimizer's copied onto ``device`` (it keeps the tensors it is given)."""
    return lambda name: unpack_state(files, name, None if name == MODEL_FILE else device)


def snapshot_tensors(module: Any, optimizer: Any) -> dict[str, Any]:
    """What a memory snapshot copies: the model's state dict with its parameters as such
    (``keep_vars``: its buffers are told apart, :func:`~ftjob.memory.node_holders.split_buffers`)
    and the optimizer's."""
    return {MODEL_FILE: module.state_dict(keep_vars=True), OPTIMIZER_FILE: optimizer.state_dict()}


def durable_state(local_dir: str, device: Any) -> Callable[[str], Any]:
    """A durable checkpoint's files in ``local_dir``: state dicts loaded onto ``device``, JSON
    records parsed."""
    import torch

    def load(name: str) -> Any:
        if name.endswith(".json"):
            with open(os.path.join(local_dir, name)) as f:
                return json.load(f)
        # weights_only: tensors and plain containers, never pickled code -- a file planted in
        # shared storage must not run at resume (torch < 2.6 unpickles anything).
        with open(os.path.join(local_dir, name), "rb") as f:
            return torch.load(f, map_location=device, weights_only=True)

    return load


class Checkpointer:
    """One worker's side of saving, agreeing on, reporting and restoring checkpoints. It decides
    its own cadence (:meth:`maybe_save`). ``fs`` is the run's retrying filesystem as the driver
    handed it to the worker; ``broadcast`` and ``report`` are the worker context's."""

    def __init__(
        self,
        *,
        fs: Any,
        run_path: str,
        config: CheckpointConfig,
        job_config: dict[str, Any],
        recorder: RunRecorder,
        world: int,
        broadcast: Callable[[Any], Any],
        report: Callable[[dict[str, Any]], None],
        metrics: M.MetricSet,
        local_root: str,
        global_batch: int,
        data: dict[str, Any] | None = None,
        schedule: CheckpointSchedule | None = None,
        fence: Callable[[], None] | None = None,
        memory: MemoryTier | None = None,
    ) -> None:
        self.fs = fs
        self.config = config
        self.job_config = job_config
        self.store = CheckpointStore(
            fs, run_path, fence, attempt=recorder.attempt, settle_s=config.lease_timeout
        )
        self.recorder = recorder
        self.rank = recorder.rank
        self.world = world
        self.broadcast = broadcast
        self.report = report
        self.metrics = metrics
        self.local_root = local_root
        self.global_batch = global_batch
        self.data = data or {}
        self.schedule = schedule or CheckpointSchedule(0, None)
        self.memory = memory
        self.source = f"attempt {recorder.attempt} rank {self.rank}"
        self.failed_uploads = 0
        self.last_error: str | None = None
        self.last_committed: str | None = None
        self.last_committed_step = -1
        self.upload_seconds = 0.0  # of the last committed upload: what a JIT checkpoint costs
        self.write_seconds = 0.0  # of the last local write
        self.report_seconds = 0.0  # of the last report barrier
        self.uploader: AsyncUploader | None = None
        if config.upload_mode == "async" and self.rank == 0:
            self.uploader = AsyncUploader(self._upload)

    # -- restore --------------------------------------------------------------------------

    def restore(self, module: Any, optimizer: Any, device: Any) -> Restored | None:
        """Every rank: the newest state that verifies, whichever tier holds it (a memory
        snapshot newer than every committed checkpoint, else the newest checkpoint that
        verifies; rank 0 picks, quarantines what does not verify, broadcasts), loaded with its
        metrics; None: step 0. Raises :class:`NoUsableCheckpoint` on every rank when committed
        checkpoints exist but none verifies (unless checkpoint.restart_if_unrecoverable)."""
        start, memory, chosen = time.perf_counter(), self.memory, None
        if not self.rank:  # a memory snapshot newer than storage, else storage's newest
            chosen = choose_restore(self.store, memory, self.local_root, self.config)
        chosen = self.broadcast(chosen)
        if isinstance(chosen, str):
            raise NoUsableCheckpoint(chosen)
        if memory is not None:
            memory.restored(chosen.step if chosen else 0)
        if chosen is None:
            return None
        step, path, local_dir = chosen.step, chosen.path, chosen.local_dir
        if chosen.tier == "memory":  # its digests came with it: the same on every rank
            assert memory is not None  # rank 0 chose from a tier every rank has
            files = memory.files(chosen)
            record, state_of = json.loads(bytes(files[STATE_FILE])), snapshot_state(files, device)
        else:
            if self.rank != 0 or local_dir is None:
                local_dir = os.path.join(self.local_root, self.store.dir_name(step))
                self.store.download(step, local_dir)
            state_of = durable_state(local_dir, device)
            record = state_of(STATE_FILE)
        state = TrainState.from_json(record)
        if state.global_batch_size != self.global_batch:
            raise RuntimeError(
                f"checkpoint {path} was trained with global batch {state.global_batch_size}, "
                f"this run uses {self.global_batch}: resuming would break exact-once data order"
            )
        elapsed = time.perf_counter() - start
        restored = Restored.of(state, chosen, elapsed, memory)
        self.metrics.load_state_dict(state.metrics)
        self.metrics.add(M.CHECKPOINT_DOWNLOAD, restored.download_s)
        loading = time.perf_counter()
        with self.metrics.timer(M.CHECKPOINT_LOAD):
            load_state(state_of, module, optimizer)
        restored.load_s = time.perf_counter() - loading
        if chosen.tier == "storage":
            shutil.rmtree(local_dir, ignore_errors=True)
        return restored

    # -- save -----------------------------------------------------------------------------

    def maybe_save(
        self,
        state: TrainState,
        module: Any,
        optimizer: Any,
        epoch_end: bool,
        guard: Callable[[], None] = lambda: None,
        section: Callable[[str], AbstractContextManager[Any]] = lambda name: nullcontext(),
    ) -> None:
        """Every rank, after every step: a checkpoint when one is due (the cadence, or the
        end of an epoch), inside ``section("checkpoint")`` (the heartbeat's: entered only
        when a checkpoint is written, so the section's learned timeout is a checkpoint's);
        ``guard`` runs first (it raises when diverged weights must never be written). Raises
        :class:`JobStopped` on every rank when the job must stop."""
        if epoch_end or self.schedule.due(state.step):
            with section("checkpoint"):
                guard()
                self.save(state, module, optimizer)
        elif self.memory is not None and self.memory.due(state.step):
            tensors = snapshot_tensors(module, optimizer)
            self.memory.take(state.step, tensors, self._records(state))

    def save(self, state: TrainState, module: Any, optimizer: Any) -> None:
        """Save and upload (rank 0), agree on the outcome, report (every rank)."""
        fatal, start = None, time.perf_counter()
        if self.rank == 0:
            local_dir = self._write_or_fail(state, module, optimizer)
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
        self._agree_and_report(fatal, state)

    def _write_or_fail(self, state: TrainState, module: Any, optimizer: Any) -> str | UploadOutcome:
        """The local copy of this step's checkpoint, or (scratch full or unwritable) the
        failed outcome, recorded: a failed checkpoint like a failed upload, not a crash."""
        start = time.perf_counter()
        try:
            with self.metrics.timer(M.CHECKPOINT_SAVE):
                local_dir = write_local_checkpoint(
                    os.path.join(self.local_root, f"out_{state.step:09d}"),
                    {MODEL_FILE: module.state_dict(), OPTIMIZER_FILE: optimizer.state_dict()},
                    self._records(state)(),
                )
        except OSError as exc:
            return self._record(UploadOutcome(state.step, None, f"OSError: {exc}", 0.0))
        self.write_seconds = time.perf_counter() - start
        return local_dir

    def _records(self, state: TrainState) -> Callable[[], dict[str, Any]]:
        """A checkpoint's JSON files, made when called: the training state as now, the config."""
        record = replace(
            state,
            global_batch_size=self.global_batch,
            world_size=self.world,
            metrics=self.metrics.state_dict(),
            data=self.data,  # what resume=true checks the train data against
            time=time.time(),
        )
        return lambda: {STATE_FILE: record.to_json(), CONFIG_FILE: self.job_config}

    def _upload(self, local_dir: str, step: int) -> UploadOutcome:
        """Upload and record the outcome at once (any thread), so a worker dying right after
        cannot lose the record."""
        outcome = upload_checkpoint(self.store, local_dir, step)
        if outcome.path is not None:
            try:
                prune(self.store, self.config.num_to_keep, self.recorder.log)
            except LeaseLost as exc:  # committed just before another driver took the run
                outcome.error, outcome.fatal = str(exc), True
        return self._record(outcome)

    def _record(self, outcome: UploadOutcome) -> UploadOutcome:
        self.recorder.checkpoint(
            CheckpointRecord(outcome.step, outcome.path, outcome.error, outcome.seconds)
        )
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

    def _plan_next(self, step: int, cost_s: float) -> None:
        """Rank 0: the next periodic checkpoint (trainer.checkpoint_every_n_steps=auto: at the
        interval that wastes least for the cost measured so far -- write, upload and the last
        report barrier's length); said when it changes."""
        before = self.schedule.interval_steps
        self.schedule.saved(step, cost_s, self.metrics.seconds_per_step())
        if self.schedule.auto and self.schedule.interval_steps != before:
            self.recorder.log(self.schedule.describe())

    def save_now(
        self, state: TrainState, module: Any, optimizer: Any, deadline: float | None = None
    ) -> JitCheckpoint:
        """A just-in-time checkpoint: this step, committed before it returns (every rank).
        A checkpoint of this step already committed (a periodic one, in flight when the
        notice came) is the JIT checkpoint. When the deadline leaves too little time for a
        checkpoint (judged by the last one's cost), none is started: the run falls back to the
        last committed one. Returns the record, the same on every rank."""
        record = JitCheckpoint(step=state.step)
        if self.rank == 0:
            start = time.perf_counter()
            record = self._save_now(state, module, optimizer, deadline)
            record = replace(record, seconds=time.perf_counter() - start)
        record = self.broadcast(record)
        if record.path:
            self._report(state)
        return record

    def _save_now(
        self, state: TrainState, module: Any, optimizer: Any, deadline: float | None
    ) -> JitCheckpoint:
        if self.uploader is not None:  # let an upload in flight finish first
            self.uploader.wait()
            self._account(self.uploader.drain())
        needed = 1.5 * (self.write_seconds + self.upload_seconds) + 1.0
        left = math.inf if deadline is None else deadline - time.time()
        if self.last_committed_step == state.step:
            return JitCheckpoint(step=state.step, path=self.last_committed, reused=True)
        if left < needed:
            reason = (
                f"{left:.1f} s to the deadline, a checkpoint takes about {needed:.1f} s: "
                f"falling back to the last committed one ({self.last_committed or 'none'})"
            )
            return JitCheckpoint(step=state.step, reason=reason)
        written = self._write_or_fail(state, module, optimizer)
        outcome = (
            written if isinstance(written, UploadOutcome) else self._upload(written, state.step)
        )
        self._account([outcome])
        return JitCheckpoint(step=state.step, path=outcome.path, reason=outcome.error)

    def finish(self, state: TrainState) -> None:
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
            self._agree_and_report(fatal, state)
            return
        fatal = self.broadcast(fatal)
        if fatal:
            raise self.recorder.fatal(fatal)

    def close(self) -> None:
        """Stop the upload thread (an attempt that ends early) and drop local scratch; the
        memory snapshot in flight gets a few seconds to reach the holder."""
        if self.memory is not None:
            self.memory.close(timeout=5.0)
        if self.uploader is not None:
            self.uploader.abandon()
        shutil.rmtree(self.local_root, ignore_errors=True)

    def _agree_and_report(self, fatal: str | None, state: TrainState) -> None:
        fatal, next_step = self.broadcast((fatal, self.schedule.next_step))
        self.schedule.follow(next_step)
        if fatal:
            raise self.recorder.fatal(fatal)
        self._report(state)

    def _report(self, state: TrainState) -> None:
        """Every rank: Ray Train's report, a barrier and its view of progress -- without the
        checkpoint: ftjob alone owns checkpoint directories (commit, restore, quarantine,
        retention), so Ray's run snapshot never names one ftjob moved or pruned."""
        committed = self.last_committed if self.rank == 0 else None
        start = time.perf_counter()
        with self.metrics.timer(M.CHECKPOINT_REPORT):
            self.report({"step": state.step, "epoch": state.epoch, "checkpoint": committed})
        self.report_seconds = time.perf_counter() - start

    def send_storage_stats(self) -> None:
        """This process's cumulative storage counters, to the ledger."""
        self.recorder.storage_stats(self.source, self.fs.snapshot_stats().as_dict())


__all__ = ["Checkpointer", "JobStopped", "NoUsableCheckpoint", "Restored", "TrainState"]
