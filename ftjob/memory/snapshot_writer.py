"""Where a memory-tier snapshot goes, on the tier's background thread
(:class:`~ftjob.memory.tier.MemoryTier`): the copy
:class:`~ftjob.memory.snapshot_copy.SnapshotCopy` makes lands in a slot of the holder's
shared-memory ring (a rank on the holder's machine: nothing is sent) or in new memory, which is
sent through Ray; then it is checked (a state that is not finite is never held), packed,
digested and committed. Rank 0's own part of each step -- its module's buffers and records --
goes to every peer holder. What ends the tier, or this worker's writes, is raised to the tier:
:class:`TierOff`, :class:`Deposed`; :class:`NoSlot` skips one snapshot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ftjob import metrics as M
from ftjob.actors import Fetch, call, tell
from ftjob.memory.format import Flat, Layout, Snapshot, digest_all, pack
from ftjob.memory.holder import HolderHandle, SnapshotHolder
from ftjob.memory.nearest_copy import holder_errors
from ftjob.memory.node_holders import BUFFERS_SUFFIX, PER_RANK_SUFFIX, split_per_rank
from ftjob.memory.ring import Arena, Ring
from ftjob.memory.snapshot_copy import SnapshotCopy, Staged
from ftjob.placement import machine


class TierOff(Exception):
    """The tier cannot go on for this run: the reason (the state does not fit
    ``checkpoint.memory.max_mb``, the holder is gone or refused the snapshot)."""


class Deposed(Exception):
    """A holder refused this worker's write: another driver holds the run (the reason)."""


class NoSlot(Exception):
    """The ring had no slot this writer may take: this snapshot is skipped (the reason)."""


class SnapshotWriter:
    """One writer's snapshots to its node's ``holder`` (and rank 0's part to its peers, listed
    by ``holders``: this node's first), every write carrying ``generation``."""

    def __init__(
        self,
        holder: HolderHandle | None,
        generation: int | None,
        rank: int,
        config: Any,  # checkpoint.memory
        copier: SnapshotCopy,
        metrics: M.MetricSet,
        fetch: Fetch,
        log: Callable[[str], None],
        holders: Callable[[], list[tuple[str, HolderHandle]]],
    ) -> None:
        self.holder, self.generation, self.rank = holder, generation, rank
        self.cap_mb, self.keep, self.copier = config.max_mb, config.keep, copier
        self.metrics, self.fetch, self.log, self.holders = metrics, fetch, log, holders
        self.ring: Ring | bool | None = None  # None: not asked yet; False: snapshots are sent
        self._rings: dict[str, Ring | None] = {}  # this process's mappings, by address
        self.opened = False  # the last snapshot opened the holder's ring (set-up, once)
        self.peers: list[tuple[str, HolderHandle]] = []  # rank 0: where its own part goes
        self._peers_at = -math.inf

    def write(self, step: int, staged: Staged, records: Callable[[], dict[str, Any]]) -> None:
        """The snapshot ``staged`` began, copied into a ring slot (or new memory, then
        sent), checked, packed, digested, committed."""
        layouts = self.copier.layouts(staged)
        size = sum(layout.nbytes for layout in layouts.values())
        if size / 2**20 > self.cap_mb:
            raise TierOff(
                f"the training state ({size / 2**20:.0f} MB) does not fit in "
                f"checkpoint.memory.max_mb={self.cap_mb:g}"
            )
        self.opened = self.ring is None
        if self.opened:
            self.ring = self._open_ring(size)
        slot, arena = None, None
        if isinstance(self.ring, Ring):
            try:
                slot, payload = self.ring.claim(self.generation)
            except Ring.Fenced as exc:
                raise Deposed(str(exc)) from None
            except Ring.Busy as exc:
                raise NoSlot(str(exc)) from None
            arena = Arena(payload)
        try:
            buffers, slot, arena = self._buffers(layouts, slot, arena)
            states = self.copier.copy(staged, layouts, buffers)
            files_records = split_per_rank(records(), self.rank)  # this rank's own, apart
            self.share(step, states, files_records)
            slot = self._send(step, states, files_records, slot, arena)
        finally:
            if slot is not None and isinstance(self.ring, Ring):  # claimed, never committed
                self.ring.release(slot)

    def _buffers(
        self, layouts: dict[str, Layout], slot: int | None, arena: Arena | None
    ) -> tuple[dict[str, Any], int | None, Arena | None]:
        """Where each file's tensors are copied: the ring slot's arena, else new memory (the
        state outgrew the ring: this snapshot and the rest are sent)."""
        import torch

        if arena is not None and slot is not None:
            try:
                return {n: arena.tensor(lay.nbytes) for n, lay in layouts.items()}, slot, arena
            except Arena.Full:
                self._outgrew_ring(slot)
        new = {n: torch.empty(layout.nbytes, dtype=torch.uint8) for n, layout in layouts.items()}
        return new, None, None

    def _open_ring(self, state_size: int) -> Ring | bool:
        """The holder's ring when this rank can write into it, else False (snapshots are sent):
        slots with room for the state and its skeletons, ``keep + 1`` of them."""
        slot_bytes = state_size + state_size // 8 + 2**20
        if self.holder is None:  # this node has no holder: nothing to write into
            return False
        try:
            asked = (slot_bytes, machine(), self.generation)
            address = self.fetch(call(self.holder, SnapshotHolder.channel, *asked))
        except holder_errors():
            return False
        ring = self.attach(address) if address else None
        self._let_go(ring)
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
        assert isinstance(self.ring, Ring)
        self.ring.release(slot)
        self.ring = False
        self.log("memory tier: the state outgrew the holder's shared memory; sent through Ray")

    def _let_go(self, ring: Ring | None) -> None:
        """This process's mappings of every ring but ``ring``: one its restore read, which
        its holder has since made again (a resumed run's other settings) -- mapped, its
        memory would stay taken beside the new one's."""
        for key, other in list(self._rings.items()):
            if other is not None and other is not ring:
                other.close()
                del self._rings[key]

    def attach(self, address: dict[str, Any]) -> Ring | None:
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
    ) -> int | None:
        """The snapshot committed in its slot, else sent; returns the slot still claimed
        (None: none is -- committed, or given up)."""
        if not all(flat.all_finite() for flat in states.values()):
            return slot  # diverged weights are never held (nor restored)
        files = pack(states, records)
        if slot is not None and arena is not None and isinstance(self.ring, Ring):
            try:
                layout = arena.place(files)
            except Arena.Full:  # sent instead (its arrays still lie in the slot: not reused)
                self._outgrew_ring(slot)
            else:
                try:
                    self.ring.commit(slot, step, layout, digest_all(files), self.generation)
                except Ring.Fenced as exc:
                    raise Deposed(str(exc)) from None
                except Ring.Busy as exc:  # the claim is no longer this writer's
                    raise NoSlot(str(exc)) from None
                self.ring.keep_newest(self.keep, self.generation)
                self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOTS, 1)
                return None
        snapshot = Snapshot.of(step, files)
        del states  # its arrays are views of the copy: the copy stays until the holder has it
        if self.holder is None:
            raise TierOff("this node has no snapshot holder")
        try:
            answer = self.fetch(call(self.holder, SnapshotHolder.put, snapshot, self.generation))
        except holder_errors() as exc:  # the holder is gone (the run is ending): storage remains
            raise TierOff(
                f"the snapshot holder did not answer ({type(exc).__name__}: {exc})"
            ) from None
        if answer.fenced:
            raise Deposed(answer.reason)
        if not answer.kept:
            raise TierOff(answer.reason)
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOTS, 1)
        return None

    def part(self, step: int, staged: Staged, records: Callable[[], dict[str, Any]]) -> None:
        """Rank 0's part of a step it did not snapshot (the last one was still being
        written), to its peers."""
        self.share(step, self.copier.held_copy(staged), split_per_rank(records(), self.rank))

    def share(self, step: int, states: dict[str, Flat], records: dict[str, Any]) -> None:
        """Rank 0, at every due step (taken or skipped): its own part of the state -- the
        module's buffers, its records: small -- to every peer holder, not waited for; there it
        completes that node's copy of the step (:mod:`ftjob.memory.node_holders`)."""
        if self.rank != 0:
            return
        if time.monotonic() - self._peers_at > 10.0:  # listing them asks Ray's GCS
            self.peers, self._peers_at = self.holders()[1:], time.monotonic()
        if not self.peers:
            return
        own = {n: r for n, r in records.items() if n.endswith(PER_RANK_SUFFIX)}
        buffers = {n: flat for n, flat in states.items() if BUFFERS_SUFFIX in n}
        part = Snapshot.of(step, pack(buffers, own))
        for _, peer in self.peers:
            try:
                tell(peer, SnapshotHolder.put_part, part, self.generation)
            except holder_errors():
                continue  # a peer gone with its node


__all__ = ["Deposed", "NoSlot", "SnapshotWriter", "TierOff"]
