"""A worker's side of the memory tier (``checkpoint.memory``, :mod:`ftjob.memory`):
taking snapshots of the training state and restoring one.

Taking: every ``every_n_steps`` steps (``auto``: the interval :class:`SnapshotCadence` picks
for the measured cost) each node's writer (rank 0 on its node) begins a snapshot of the model's
and optimizer's state; the training thread takes only what the next forward pass would change
(the module's buffers: small), and a background thread copies the rest while the next step
trains -- that step waits before its ``optimizer.step()`` until the copy no longer reads what
the optimizer changes (:mod:`ftjob.memory.snapshot_copy`: on a GPU a side stream into the
page-locked ring, the training stream ordered after it). The same thread then checks, packs
(:func:`~ftjob.memory.format.pack`: each tensor's bytes as an array, the rest as small
files), digests and commits it (:mod:`ftjob.memory.snapshot_writer`): on the holder's machine
the copy lies in a slot of the holder's ring (shared memory; nothing is sent), elsewhere it is
sent through Ray. One snapshot is in flight at a time; a due snapshot while one is still being
written is skipped (training never waits for the tier). The state is the same on every rank
(DDP), so rank 0's copy serves all of them.

Restoring: rank 0 offers the newest held snapshot that is newer than every committed durable
checkpoint and verifies; every rank loads it. A snapshot that fails verification is dropped
from the holder with a line, never loaded.

Every write to a holder carries the lease generation of this worker's driver
(:mod:`ftjob.memory.fence`). A holder fenced by a newer one -- another driver took the
run, and this worker outlived its own driver -- refuses it: the tier turns itself off with the
holder's reason (:attr:`MemoryTier.fenced`), and the worker's next checkpoint commit meets the
run lease's own fence, which stops it. A live run's workers are never refused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ftjob import metrics as M
from ftjob.actors import Fetch
from ftjob.config import MemoryConfig
from ftjob.memory.format import Buffer, Snapshot
from ftjob.memory.nearest_copy import NearestCopy, holder_errors
from ftjob.memory.node_holders import bind_holders, merge_per_rank
from ftjob.memory.ring import Ring
from ftjob.memory.snapshot_copy import SnapshotCopy
from ftjob.memory.snapshot_writer import Deposed, NoSlot, SnapshotWriter, TierOff
from ftjob.policy.cadence import SnapshotCadence
from ftjob.record import Holder
from ftjob.storage.checkpoint import RestoreChoice

logger = logging.getLogger(__name__)

MEMORY_PREFIX = "memory:"
# A CPU worker's copy runs beside the next step as a GPU worker's does: measured no slower than
# the copy on the training thread on 2 cores, loaded (benchmarks/RESULTS.md, 2026-12-07). False
# waits for it in take().
OVERLAP_CPU = True


class MemoryTier:
    """Rank 0 takes snapshots; every rank restores from one. ``holder``: the run's
    :class:`~ftjob.memory.holder.SnapshotHolder` handle; ``fetch`` resolves its answers."""

    reader: NearestCopy

    def __init__(
        self,
        holder: Any,
        config: MemoryConfig,
        rank: int,
        metrics: M.MetricSet,
        fetch: Fetch,
        log: Callable[[str], None],
    ) -> None:
        self.holder = holder
        self.fenced: str | None = None  # why a holder refused this worker's writes
        self.cadence = SnapshotCadence(config.every_n_steps, config.max_overhead)
        self.copier = SnapshotCopy()
        self.overlap_cpu = OVERLAP_CPU
        self._copy_s = 0.0  # the last snapshot's time in take()
        self._wait_s = 0.0  # and at settle(), the device's wait included
        self._on_gpu = False  # its state lies on a GPU
        self._background_s: float | None = None  # its thread's CPU, until the cadence has it
        self.rank, self.metrics, self.fetch, self.log = rank, metrics, fetch, log
        self.place = bind_holders(holder, rank)  # this node's holder and its peers'
        self.generation = self.place.generation  # what every write to a holder carries
        self.holder = self.place.local()
        self.enabled = self.holder is not None
        holders = lambda: self.reader.holders()  # noqa: E731 -- the reader is made next
        self.writer = SnapshotWriter(
            self.holder, self.generation, rank, config, self.copier, metrics, fetch, log, holders
        )
        self.reader = NearestCopy(self.place, self.holder, rank, fetch, log, self.writer.attach)
        # One thread copies and commits (or sends) the snapshots, one at a time -- `_idle` while
        # none is in flight --, and rank 0's parts of the steps it skipped after it.
        self._work: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._offered: Snapshot | None = None  # rank 0: the snapshot a restore chose
        self.skipped = 0
        self.busy: str | None = None  # why the ring had no slot for the last snapshot

    # -- taking ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        if not (self.enabled and self.place.writes):
            return False
        self._plan()
        return self.cadence.due(step)

    def _plan(self) -> None:
        """The cadence learns the last snapshot's cost once it is known: what it took from the
        training thread (its part of :meth:`take` and the wait at :meth:`settle`, the device's
        included) and, on the CPU, its background work's CPU, which takes cores from the step
        there (on a GPU worker the step runs on the device). With ``every_n_steps=auto`` the
        first interval chosen is said."""
        stalled = self.copier.stalled()
        if stalled:
            self._lost(stalled)
        if self._background_s is None or not self._idle.is_set() or self.copier.measuring:
            return
        cost = self._copy_s + self._wait_s + (0.0 if self._on_gpu else self._background_s)
        self._background_s, self._wait_s = None, 0.0
        if self.writer.opened:  # set-up, once an attempt: not what a snapshot costs
            self.cadence.again()
        elif self.cadence.measured(cost, self.metrics.seconds_per_step()):
            self.log(self.cadence.describe())

    def take(
        self, step: int, tensors: dict[str, Any], records: Callable[[], dict[str, Any]]
    ) -> None:
        """The writer, after ``step``: the snapshot of ``step`` begins. On this thread only
        the module's buffers are taken (the next forward pass changes them); the weights and
        the optimizer's state are copied on the background thread while the next step trains,
        and that step waits at :meth:`settle`, before its optimizer changes them
        (:mod:`ftjob.memory.snapshot_copy`). ``tensors``: file name -> state dict (model,
        optimizer); ``records``: the snapshot's JSON files (state.json, config.json), called
        on the background thread -- it must read only what it took when it was made. On the
        holder's machine the copy goes straight into a slot of the holder's ring, and nothing
        is sent."""
        start = time.perf_counter()
        if not self._idle.is_set():
            self.skipped += 1  # the previous one is still being sent: training goes on
            if self.writer.peers:  # rank 0's part still reaches them: they may take this step
                self._submit(("part", step, self.copier.begin(tensors, part=True), records))
            return
        staged = self.copier.begin(tensors)
        self._on_gpu = staged.device is not None
        self.cadence.taken(step)
        self._idle.clear()
        self._submit(("snapshot", step, staged, records))
        if not (self._on_gpu or self.overlap_cpu):  # the copy waited for here (OVERLAP_CPU)
            self.copier.settle()
        self._copy_s = time.perf_counter() - start
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME, self._copy_s)

    def settle(self) -> None:
        """The training thread, before ``optimizer.step()``: the snapshot begun last no longer
        reads what the step changes (:meth:`SnapshotCopy.settle`). The wait is the snapshot's
        (``checkpoint/memory_snapshot_time`` and ``_wait``), so it leaves the step's own time
        (``train/step``, whose timer holds it): goodput counts it once, and step time stays
        the step's own for the cadences."""
        waited = self.copier.settle()
        if waited:
            self._lost(waited)

    def _lost(self, seconds: float) -> None:
        """The training lost ``seconds`` to the snapshot's copy -- its thread at
        :meth:`settle`, or on a GPU the device's stream, timed there and known a few steps
        later (:meth:`SnapshotCopy.stalled`): the snapshot's time, taken out of the step's."""
        self._wait_s += seconds
        self.metrics.add(M.TRAIN_STEP, -seconds)
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT, seconds)
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME, seconds)

    def _submit(self, work: tuple[Any, ...]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ftjob-snapshot", daemon=True)
            self._thread.start()
        self._work.put(work)

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            kind, step, staged, records = work
            cpu = time.thread_time()
            try:
                with _on(staged.device):
                    if kind == "snapshot":
                        self.writer.write(step, staged, records)
                        self.busy = None
                    elif self.enabled:
                        self.writer.part(step, staged, records)
            except NoSlot as exc:
                self._no_slot(step, str(exc))
            except TierOff as exc:
                self._turn_off(str(exc))
            except Deposed as exc:
                self._deposed(str(exc))
            except Exception as exc:  # the thread's boundary: it must live on to serve `close`
                logger.exception("memory tier: a snapshot failed")  # the bug, in the worker log
                self._turn_off(f"a snapshot failed ({type(exc).__name__}: {exc})")
            finally:
                if kind == "snapshot":
                    self.copier.release()  # copied or dropped: the step never waits for it
                    self._background_s = time.thread_time() - cpu
                    self._idle.set()

    @property
    def ring(self) -> Ring | bool | None:
        """The holder's ring this writer writes into (None: not asked yet; False: snapshots
        are sent)."""
        return self.writer.ring

    @ring.setter
    def ring(self, ring: Ring | bool | None) -> None:
        self.writer.ring = ring

    def _no_slot(self, step: int, why: str) -> None:
        """No ring slot for this snapshot: skipped, said once until a snapshot gets one."""
        self.skipped += 1
        if self.busy is None:
            self.log(f"memory tier: the snapshot of step {step} is skipped: {why}")
        self.busy = why

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            self.log(f"memory tier off for this run: {why}; restores read storage")

    def _deposed(self, why: str) -> None:
        """A holder refused this worker's write: its driver no longer holds the run. No more
        snapshots (the run lease's fence stops the worker at its next checkpoint commit)."""
        self.fenced = why
        if self.enabled:
            self.enabled = False
            logger.warning("memory tier: %s", why)
            self.log(f"memory tier off for this worker: {why}; it writes no more snapshots")

    def wait(self, timeout: float | None = None) -> None:
        """Until the snapshot in flight, if any, is held (or ``timeout`` seconds)."""
        self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        """An attempt that ends (an error, a notice) first lets its newest snapshot reach the
        holder, then the sending thread end -- both within ``timeout`` seconds: a process that
        exits while the thread copies ends it inside torch's work ("terminate called without
        an active exception")."""
        deadline = time.monotonic() + timeout
        self.wait(timeout)
        thread, self._thread = self._thread, None
        if thread is not None:
            self._work.put(None)  # a thread stuck in a call to a holder that is gone never reads it
            thread.join(max(0.0, deadline - time.monotonic()))  # such a one is left behind

    def restored(self, step: int) -> None:
        """After every restore (of either tier, or of nothing: step 0), rank 0 drops the
        snapshots past ``step`` from every holder: they belong to the attempt that was lost."""
        if self.holder is None or self.rank != 0:
            return
        if not self.reader.drop_after(step):
            self._turn_off("the snapshot holder did not answer")
        if self.reader.refused is not None:
            self._deposed(self.reader.refused)

    # -- restoring (:class:`~ftjob.memory.nearest_copy.NearestCopy`) ----------------------

    @property
    def source(self) -> Holder:
        """Whose copy the last restore read: this node's holder, or a peer's."""
        return self.reader.source

    def newest(self, committed: Callable[[], list[tuple[int, int]]]) -> Snapshot | None:
        return self.reader.newest(committed) if self.holder is not None else None

    def offer(self, committed: Callable[[], list[tuple[int, int]]]) -> RestoreChoice | None:
        """Rank 0: the restore choice for the newest verified snapshot newer than storage
        (:meth:`newest`; ``committed()``: storage's newest checkpoint as (lease generation,
        step)), or None."""
        self._offered = self.newest(committed)
        if self._offered is None:
            return None
        step = self._offered.step
        return RestoreChoice(
            step,
            f"{MEMORY_PREFIX}step_{step:09d}",
            tier="memory",
            digests=tuple(sorted(self._offered.digests.items())),
            node=self.reader.node_read,
        )

    def files(self, chosen: RestoreChoice) -> dict[str, Buffer]:
        """Every rank: the files of the snapshot rank 0 chose (rank 0 verified its own
        copy; the others verify theirs and that it is the same one)."""
        offered, self._offered = self._offered, None  # not kept past the restore
        if self.rank == 0 and offered is not None and offered.step == chosen.step:
            return merge_per_rank(offered.files)
        return merge_per_rank(self.chosen(chosen.step, dict(chosen.digests), chosen.node).files)

    def chosen(self, step: int, digests: dict[str, str], node: str | None = None) -> Snapshot:
        return self.reader.chosen(step, digests, node)

    def get(self, step: int) -> Snapshot | None:
        return self.reader.get(step)


def _on(device: Any) -> AbstractContextManager[Any]:
    """The background thread's work for a state on ``device`` (a GPU: its CUDA calls go to
    that device, as the training thread's do), else nothing."""
    if device is None:
        return nullcontext()
    import torch

    return torch.cuda.device(device)


__all__ = ["MEMORY_PREFIX", "MemoryTier", "holder_errors"]
