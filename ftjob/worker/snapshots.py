"""A worker's side of the memory tier (``checkpoint.memory``, :mod:`ftjob.storage.memory`):
taking snapshots of the training state and restoring one.

Taking: every ``every_n_steps`` steps (``auto``: the interval :class:`SnapshotCadence` picks
for the measured cost) rank 0 copies the model's and optimizer's tensors (the
only part on the training thread: a memory copy, so the next step can change the weights) and
hands the copy to a background thread, which packs it
(:func:`~ftjob.storage.memory.format.pack`: each tensor's bytes as an array, the rest as small
files), digests it and gives it to the run's holder. On the holder's machine the copy is made
straight into a slot of the holder's ring (shared memory; the thread commits the slot, nothing
is sent); elsewhere the thread sends it through Ray. One snapshot is in flight at a time; a due
snapshot while one is still being sent is skipped (training never waits for the tier). The
state is the same on every rank (DDP), so rank 0's copy serves all of them.

Restoring: rank 0 offers the newest held snapshot that is newer than every committed durable
checkpoint and verifies; every rank loads it. A snapshot that fails verification is dropped
from the holder with a line, never loaded.

Every write to a holder carries the lease generation of this worker's driver
(:mod:`ftjob.storage.memory.fence`). A holder fenced by a newer one -- another driver took the
run, and this worker outlived its own driver -- refuses it: the tier turns itself off with the
holder's reason (:attr:`MemoryTier.fenced`), and the worker's next checkpoint commit meets the
run lease's own fence, which stops it. A live run's workers are never refused.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ftjob import metrics as M
from ftjob.config import MemoryConfig
from ftjob.policy.cadence import SnapshotCadence
from ftjob.record import Holder
from ftjob.storage.checkpoint import RestoreChoice
from ftjob.storage.memory.format import Buffer, Flat, Snapshot, digest_all, pack, state_bytes
from ftjob.storage.memory.ring import Arena, Ring, machine
from ftjob.worker.nearest_copy import NearestCopy, holder_errors
from ftjob.worker.node_holders import (
    BUFFERS_SUFFIX,
    PER_RANK_SUFFIX,
    bind_holders,
    merge_per_rank,
    split_buffers,
    split_per_rank,
)

logger = logging.getLogger(__name__)

MEMORY_PREFIX = "memory:"


class MemoryTier:
    """Rank 0 takes snapshots; every rank restores from one. ``holder``: the run's
    :class:`~ftjob.storage.memory.holder.SnapshotHolder` handle; ``fetch`` resolves its answers."""

    def __init__(
        self,
        holder: Any,
        config: MemoryConfig,
        rank: int,
        metrics: M.MetricSet,
        fetch: Callable[[Any], Any],
        log: Callable[[str], None],
    ) -> None:
        self.holder, self.cap_mb, self.keep = holder, config.max_mb, config.keep
        self.fenced: str | None = None  # why a holder refused this worker's writes
        self.cadence = SnapshotCadence(config.every_n_steps, config.max_overhead)
        self._copy_s = 0.0  # the last snapshot's time on the training thread
        self._background_s: float | None = None  # its thread's CPU, until the cadence has it
        self.ring: Ring | bool | None = None  # None: not asked yet; False: snapshots are sent
        self._rings: dict[str, Ring | None] = {}  # a reader's mappings, by address
        self.rank, self.metrics, self.fetch, self.log = rank, metrics, fetch, log
        self.place = bind_holders(holder, rank)  # this node's holder and its peers'
        self.generation = self.place.generation  # what every write to a holder carries
        self.holder = self.place.local()
        self.enabled = self.holder is not None
        self.reader = NearestCopy(self.place, self.holder, rank, fetch, log, self._attach)
        self._peers: list[tuple[str, Any]] = []  # rank 0: the holders its own part goes to
        self._peers_at = -math.inf
        # One thread sends (or commits) the snapshots, one at a time; `_idle` while none is
        # in flight.
        self._work: queue.Queue[tuple[Any, ...] | None] = queue.Queue(maxsize=1)
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
        """The cadence learns the last snapshot's cost once its background work has ended:
        the copy on the training thread plus that work's CPU, which on a machine whose cores
        the step holds (CPU training) is what it takes from training (an upper bound
        elsewhere). With ``every_n_steps=auto`` the first interval chosen is said."""
        if self._background_s is None or not self._idle.is_set():
            return
        cost, self._background_s = self._copy_s + self._background_s, None
        if self.cadence.measured(cost, self.metrics.seconds_per_step()):
            self.log(self.cadence.describe())

    def take(
        self, step: int, tensors: dict[str, Any], records: Callable[[], dict[str, Any]]
    ) -> None:
        """Rank 0, after ``step``: copy the state (the stall) and send it in the background.
        ``tensors``: file name -> state dict (model, optimizer); ``records``: the JSON files
        of the snapshot (state.json, config.json), built now. On the holder's machine the
        copy goes straight into a slot of the holder's ring, and nothing is sent."""
        start = time.perf_counter()
        tensors = split_buffers(tensors)  # the module's buffers: this rank's own, apart
        files_records = split_per_rank(records(), self.rank)  # this rank's own, apart
        self._share(step, tensors, files_records)
        if not self._idle.is_set():
            self.skipped += 1  # the previous one is still being sent: training goes on
            return
        size = state_bytes(tensors)
        if size / 2**20 > self.cap_mb:
            self._turn_off(
                f"the training state ({size / 2**20:.0f} MB) does not fit in "
                f"checkpoint.memory.max_mb={self.cap_mb:g}"
            )
            return
        if self.ring is None:
            self.ring = self._open_ring(size)
        slot, arena = None, None
        if self.ring:
            try:
                slot, payload = self.ring.claim(self.generation)
            except Ring.Fenced as exc:
                self._deposed(str(exc))
                return
            except Ring.Busy as exc:
                return self._no_slot(step, str(exc))
            arena = Arena(payload)
        try:
            copied = {
                name: Flat.copy_of(state, arena.tensor if arena else None)
                for name, state in tensors.items()
            }
        except Arena.Full:
            self._outgrew_ring(slot)
            slot = arena = None
            copied = {name: Flat.copy_of(state) for name, state in tensors.items()}
        self._copy_s = time.perf_counter() - start
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME, self._copy_s)
        self.cadence.taken(step)
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ftjob-snapshot", daemon=True)
            self._thread.start()
        self._work.put((step, copied, files_records, slot, arena))

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            cpu = time.thread_time()
            try:
                self._send(*work)
            except Exception as exc:  # the thread's boundary: it must live on to serve `close`
                logger.exception("memory tier: a snapshot failed")  # the bug, in the worker log
                self._turn_off(f"a snapshot failed ({type(exc).__name__}: {exc})")
            finally:
                self._background_s = time.thread_time() - cpu
                self._idle.set()

    def _open_ring(self, state_size: int) -> Ring | bool:
        """The holder's ring when this rank can write into it, else False (snapshots are sent):
        slots with room for the state and its skeletons, ``keep + 1`` of them."""
        slot_bytes = state_size + state_size // 8 + 2**20
        try:
            address = self.fetch(self.holder.channel.remote(slot_bytes, machine(), self.generation))
        except holder_errors():
            return False
        ring = self._attach(address) if address else None
        locked = ring is not None and (ring.locked is not None or ring.page_lock())
        self.log(
            "memory tier: snapshots go into the holder's shared memory (this machine"
            + (", page-locked for the GPU's copies)" if locked else ")")
            if ring is not None
            else "memory tier: snapshots are sent to the holder through Ray"
        )
        return ring or False

    def _outgrew_ring(self, slot: int) -> None:
        """The state outgrew the ring's slots: this snapshot and the rest are sent."""
        self.ring.release(slot)
        self.ring = False
        self.log("memory tier: the state outgrew the holder's shared memory; sent through Ray")

    def _attach(self, address: dict[str, Any]) -> Ring | None:
        """This process's mapping of the holder's ring (one per ring), or None: it cannot
        map it (another machine)."""
        key = address["path"] + address["token"]
        if key not in self._rings:
            self._rings[key] = Ring.attach(address)
        return self._rings[key]

    def _send(
        self,
        step: int,
        states: dict[str, Flat],
        records: dict[str, Any],
        slot: int | None,
        arena: Arena | None,
    ) -> None:
        if not all(flat.all_finite() for flat in states.values()):
            if slot is not None:
                self.ring.release(slot)
            return  # diverged weights are never held (nor restored)
        files = pack(states, records)
        if slot is not None:
            try:
                layout = arena.place(files)
            except Arena.Full:  # sent instead (its arrays still lie in the slot: not reused)
                self._outgrew_ring(slot)
            else:
                try:
                    self.ring.commit(slot, step, layout, digest_all(files), self.generation)
                except Ring.Fenced as exc:
                    self._deposed(str(exc))
                    return
                except Ring.Busy as exc:  # the claim is no longer this writer's
                    return self._no_slot(step, str(exc))
                self.busy = None
                self.ring.keep_newest(self.keep, self.generation)
                self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOTS, 1)
                return
        snapshot = Snapshot.of(step, files)
        del states  # its arrays are views of the copy: the copy stays until the holder has it
        try:
            answer = self.fetch(self.holder.put.remote(snapshot, self.generation))
        except holder_errors() as exc:  # the holder is gone (the run is ending): storage remains
            self._turn_off(f"the snapshot holder did not answer ({type(exc).__name__}: {exc})")
            return
        if answer.fenced:
            self._deposed(answer.reason)
            return
        if not answer.kept:
            self._turn_off(answer.reason)
            return
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOTS, 1)

    def _share(self, step: int, tensors: dict[str, Any], records: dict[str, Any]) -> None:
        """Rank 0, at every due step (taken or skipped): its own part of the state -- the
        module's buffers, its records: small -- to every peer holder, not waited for; there it
        completes that node's copy of the step (:mod:`ftjob.worker.node_holders`)."""
        if self.rank != 0 or not self.enabled:
            return
        if time.monotonic() - self._peers_at > 10.0:  # listing them asks Ray's GCS
            self._peers, self._peers_at = self.reader.holders()[1:], time.monotonic()
        if not self._peers:
            return
        states = {n: Flat.copy_of(s) for n, s in tensors.items() if BUFFERS_SUFFIX in n}
        own = {n: r for n, r in records.items() if n.endswith(PER_RANK_SUFFIX)}
        part = Snapshot.of(step, pack(states, own))
        for _, peer in self._peers:
            try:
                peer.put_part.remote(part, self.generation)
            except holder_errors():
                continue  # a peer gone with its node

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
        holder (up to ``timeout`` seconds); then the sending thread ends."""
        self.wait(timeout)
        if self._thread is not None:
            try:
                self._work.put(None, timeout=5.0)
            except queue.Full:  # the thread is stuck in a call to a holder that is gone
                pass
            self._thread = None

    def restored(self, step: int) -> None:
        """After every restore (of either tier, or of nothing: step 0), rank 0 drops the
        snapshots past ``step`` from every holder: they belong to the attempt that was lost."""
        if self.holder is None or self.rank != 0:
            return
        if not self.reader.drop_after(step):
            self._turn_off("the snapshot holder did not answer")
        if self.reader.refused is not None:
            self._deposed(self.reader.refused)

    # -- restoring (:class:`~ftjob.worker.nearest_copy.NearestCopy`) ----------------------

    @property
    def source(self) -> Holder:
        """Whose copy the last restore read: this node's holder, or a peer's."""
        return self.reader.source

    def newest(self, committed: Callable[[], list[int]]) -> Snapshot | None:
        return self.reader.newest(committed) if self.holder is not None else None

    def offer(self, committed: Callable[[], list[int]]) -> RestoreChoice | None:
        """Rank 0: the restore choice for the newest verified snapshot newer than storage
        (:meth:`newest`), or None."""
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


__all__ = ["MEMORY_PREFIX", "MemoryTier", "holder_errors"]
