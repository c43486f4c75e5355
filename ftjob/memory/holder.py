"""The memory tier's holder: the newest snapshots of a run, kept by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

In a run each node that runs training ranks has one, a :class:`NodeHolder`: a detached Ray
actor pinned to its node and named by the run (:mod:`ftjob.memory.cluster`), so a
worker's death leaves it, the loss of a node leaves the other nodes', and a driver's death leaves
them all where the cluster lives on. A rank on the holder's machine writes its snapshots into the
holder's shared-memory :class:`~ftjob.memory.ring.Ring` (no call per snapshot); a rank
elsewhere sends each one through Ray. (:func:`start_holder`: one holder owned by this process,
on its node, for measurements.) Every write carries the lease generation of the driver whose
worker makes it, and a holder offers nothing a deposed driver's workers wrote after the next
driver fenced it (:mod:`ftjob.memory.fence`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ftjob.actors import Actor
from ftjob.memory.fence import GenerationFence, Refused
from ftjob.memory.format import Snapshot
from ftjob.memory.ring import Ring, SlotEntry
from ftjob.memory.traffic import HolderTraffic
from ftjob.placement import machine, start_pinned_actor


@dataclass(frozen=True)
class RingRef:
    """The holder's answer for a snapshot that lies in its ring: where to map it. A reader
    that cannot (another machine) asks the holder for a copy (``SnapshotHolder.copy``).
    ``nonce``: the commit of the slot the holder offers (a reader reads that one, or none)."""

    address: dict[str, Any]
    step: int
    nonce: int | None = None


@dataclass(frozen=True)
class PutAnswer:
    """A holder's answer to a snapshot sent (:meth:`SnapshotHolder.put`): kept, with the steps
    it dropped to make room; or not kept, and why -- ``fenced``: the fence refused its writer."""

    kept: bool
    dropped: list[int] = field(default_factory=list)
    reason: str = ""
    fenced: bool = False


class SnapshotHolder:
    """The newest snapshots of a run, at most ``keep`` and ``cap_bytes`` together. A snapshot
    bigger than the cap is refused (the caller turns the tier off); older ones are dropped to
    make room for a newer one.

    Snapshots arrive two ways. A rank on the holder's machine writes them into the holder's
    :class:`Ring` (:meth:`channel` creates it once, ``keep + 1`` slots within the cap) with no
    call per snapshot; any other rank sends each one (:meth:`put`). Both are listed, offered
    and dropped alike, as far as the run's fence admits them (:meth:`fence`; a write's
    ``generation``: its driver's lease generation, None where the run has no lease)."""

    def __init__(
        self,
        cap_bytes: int,
        keep: int,
        object_store: bool = False,
        orphan_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap_bytes, self.keep, self.object_store = cap_bytes, keep, object_store
        self.snapshots: dict[int, Any] = {}  # step -> its Snapshot, or its ObjectRef
        self.sizes: dict[int, int] = {}
        self.gate = GenerationFence()  # the run's lease generation, as the holder was told
        self.born: dict[int, int | None] = {}  # step -> the generation of its snapshot's writer
        self.part_born: dict[int, int | None] = {}  # of its part's
        self.taken = self.dropped = 0
        self.ring: Ring | None = None
        self.parts: dict[int, Snapshot] = {}  # step -> rank 0's own part of a peer's snapshot
        self.orphan_timeout_s, self.clock = orphan_timeout_s, clock
        self.claimed = clock()
        self.received = HolderTraffic()  # what came through calls (the ring's: traffic())

    def claim(self) -> None:
        """A driver of the run is alive: the holder is kept (for ``orphan_timeout_s`` more)."""
        self.claimed = self.clock()

    def orphaned(self) -> bool:
        """No driver claimed it for ``orphan_timeout_s``: the run's driver died and no next
        one came (a holder without the timeout never is)."""
        timeout = self.orphan_timeout_s
        return timeout is not None and self.clock() - self.claimed > timeout

    def settings(self) -> dict[str, float]:
        """What the holder was made with, as ``checkpoint.memory`` names it."""
        timeout = self.orphan_timeout_s
        return {
            "max_mb": self.cap_bytes / 2**20,
            "keep": self.keep,
            "orphan_timeout_s": timeout or 0,
        }

    def configure(
        self, cap_bytes: int, keep: int, orphan_timeout_s: float, generation: int | None = None
    ) -> dict[str, float] | Refused | None:
        """A resumed run's driver (of lease ``generation``) found the holder that outlived the
        last one: it takes this run's settings -- its settings before, where they differ, else
        None; refused when the fence knows a newer driver. What it holds beyond them goes,
        oldest first; a ring of another shape is made again for the run's first writer (the
        restore has read it by then: :meth:`channel`)."""
        refused = self.gate.refuses(generation, "the settings", by="a driver")
        if refused is not None:
            return refused
        before = self.settings()
        self.cap_bytes, self.keep, self.orphan_timeout_s = cap_bytes, keep, orphan_timeout_s
        while self.snapshots and (
            len(self.snapshots) > keep or self._sent_bytes() > cap_bytes - self._ring_bytes()
        ):
            self._drop(min(self.snapshots))
            self.dropped += 1
        return before if before != self.settings() else None

    def release(self) -> None:
        """Every snapshot and the ring let go (the run ended, or no driver claims it)."""
        for step in list(self.snapshots):
            self._drop(step)
        self.parts.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def fence(self, generation: int) -> Refused | None:
        """The driver of lease ``generation`` took the run, before its workers start: writes of
        older generations are refused from now on; what the holder has of older, known
        generations was committed before the takeover and stays restorable, the rest is never
        offered. Refused when the holder knows a newer generation (this driver is deposed)."""
        refused = self.gate.refuses(generation, "the fence", by="a driver")
        if refused is None and self.gate.newer(generation):
            self._take_over(generation, admit=True)
        return refused

    def _admit(self, generation: int | None, what: str) -> Refused | None:
        """A write (``what``) by a worker of ``generation``: refused when older than the
        fence; taken otherwise, a newer generation moving the fence on (admitting nothing
        older: no driver of it fenced this holder)."""
        refused = self.gate.refuses(generation, what)
        if refused is None and generation is not None and self.gate.newer(generation):
            self._take_over(generation, admit=False)
        return refused

    def _take_over(self, generation: int, admit: bool) -> None:
        held: list[tuple[int | None, Hashable]]
        held = [(self.born.get(s), ("sent", s)) for s in self.snapshots]
        held += [(self.part_born.get(s), ("part", s)) for s in self.parts]
        entries = self.ring.entries() if self.ring is not None else []
        held += [(e.generation or None, ("ring", e.slot, e.nonce)) for e in entries]
        self.gate.take_over(generation, held, admit)
        for step in [s for s in self.snapshots if ("sent", s) not in self.gate.admitted]:
            self._forget(step)  # never offered again: its memory back
        self.parts = {s: p for s, p in self.parts.items() if ("part", s) in self.gate.admitted}
        if self.ring is not None:
            self.ring.set_fence(generation)
            # Nor the ring's: emptied, so that a stale slot of a later step is never kept as
            # the newest in place of the live writer's (Ring.keep_newest).
            for e in entries:
                if ("ring", e.slot, e.nonce) not in self.gate.admitted:
                    self.ring.discard(e.slot, e.nonce)

    def _reader(self, generation: int | None, what: str) -> bool:
        """May a reader of lease ``generation`` read? A reader of a newer generation than the
        holder knows moves the fence on first, as a writer does (a holder its driver did not
        fence: one created after the takeover, which a deposed driver's worker may have
        written first), so it is offered nothing older; an older one is refused. None: a
        reader that claims no generation (a measurement), offered what the fence admits."""
        if generation is None:
            return True
        refused = self.gate.refuses(generation, what, count=False)  # reads are not writes
        if refused is None and self.gate.newer(generation):
            self._take_over(generation, admit=False)
        return refused is None

    def channel(
        self, slot_bytes: int, where: str, generation: int | None = None
    ) -> dict[str, Any] | None:
        """The ring's address for a writer on machine ``where`` (:func:`machine`) whose
        snapshots take at most ``slot_bytes`` (creating the ring the first time), or None:
        the writer sends them (:meth:`put`). None for a writer on another machine, when
        ``keep + 1`` such slots do not fit in the cap, when the ring has smaller slots, where
        there is no shared memory to make one, or for a writer the fence refuses."""
        if self._admit(generation, "a ring") is not None:
            return None
        if not where or where != machine():
            return None
        if self.ring is not None and not self._ring_fits():  # made before the settings changed
            self.ring.close()
            self.ring = None
        if self.ring is None:
            slots = self.keep + 1  # the newest `keep`, and the one being written
            if Ring.size(slots, slot_bytes) > self.cap_bytes - self._sent_bytes():
                return None
            try:
                self.ring = Ring.create(slots, slot_bytes)
            except (OSError, AttributeError):  # no memfd here (AttributeError: not Linux)
                return None
            self.ring.set_fence(self.gate.generation or 0)
        return self.ring.address if slot_bytes <= self.ring.slot_bytes else None

    def put(self, snapshot: Snapshot, generation: int | None = None) -> PutAnswer:
        """Keep ``snapshot``, written by a worker of lease ``generation``; not kept when it
        cannot fit under the cap, or when the fence refuses its writer. As a Ray actor
        (``object_store``) it keeps its copy in Ray's object store, owned by itself: a reader
        on this node maps it without a copy. A step already held is kept as it is (a copy
        from a peer that another rank of this node put first)."""
        self.received = self.received.add_sent(snapshot.nbytes)
        refused = self._admit(generation, f"the snapshot of step {snapshot.step}")
        if refused is not None:
            return PutAnswer(False, reason=refused.reason, fenced=True)
        if snapshot.step in self._held():
            return PutAnswer(True)
        room = self.cap_bytes - self._ring_bytes()
        if snapshot.nbytes > room and self.ring is not None and not self.ring.counts()[0]:
            self.ring.close()  # made for a writer that never wrote into it: its room back
            self.ring, room = None, self.cap_bytes
        if snapshot.nbytes > room:
            return PutAnswer(
                False,
                reason=f"a snapshot of {snapshot.nbytes / 2**20:.0f} MB does not fit in "
                f"{room / 2**20:.0f} MB",
            )
        if self.object_store:
            import ray

            self.snapshots[snapshot.step] = ray.put(snapshot)
        else:
            self.snapshots[snapshot.step] = snapshot.own()
        self.sizes[snapshot.step] = snapshot.nbytes
        self.born[snapshot.step] = generation
        self.taken += 1
        dropped = []
        while len(self.snapshots) > self.keep or self._sent_bytes() > room:
            dropped.append(self._drop(min(self.snapshots)))
        self.dropped += len(dropped)
        return PutAnswer(True, dropped)

    def put_part(self, part: Snapshot, generation: int | None = None) -> Refused | None:
        """Rank 0's own part of its snapshot of ``part.step`` (its module's buffers, its
        records: small), which completes this node's copy of that step, written by another
        rank. The newest ``keep + 1`` are kept."""
        self.received = self.received.add_part(part.nbytes)
        refused = self._admit(generation, f"rank 0's part of step {part.step}")
        if refused is not None:
            return refused
        self.parts[part.step], self.part_born[part.step] = part.own(), generation
        for step in sorted(self.parts)[: -(self.keep + 1)]:
            del self.parts[step]
        return None

    def part(self, step: int, generation: int | None = None) -> Snapshot | None:
        if not self._reader(generation, f"a read of rank 0's part of step {step}"):
            return None
        return self.parts.get(step)

    def _drop(self, step: int) -> int:
        self.parts.pop(step, None)
        self._forget(step)
        if self.ring is not None:
            self.ring.drop(step)
        return step

    def _forget(self, step: int) -> None:
        """The sent snapshot of ``step`` let go."""
        self.snapshots.pop(step, None)
        self.sizes.pop(step, None)
        self.born.pop(step, None)

    def _sent_bytes(self) -> int:
        return sum(self.sizes[step] for step in self.snapshots)

    def held_bytes(self) -> int:
        """The snapshots sent, and the whole ring (its memory is taken when it is made)."""
        return self._sent_bytes() + self._ring_bytes()

    def _ring_bytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def _ring_fits(self) -> bool:
        """Is the ring of the holder's settings: ``keep + 1`` slots, within the cap?"""
        ring = self.ring
        return ring is None or (ring.slots == self.keep + 1 and ring.nbytes <= self.cap_bytes)

    def _offered(self) -> dict[int, SlotEntry]:
        """Step -> slot of the ring's snapshots the fence admits (what a restore may read)."""
        entries = self.ring.entries() if self.ring is not None else []
        return {
            e.step: e
            for e in entries
            if self.gate.admits(e.generation or None, ("ring", e.slot, e.nonce))
        }

    def _held(self) -> set[int]:
        """The steps a restore may read (every sent snapshot held is one the fence admits)."""
        return set(self.snapshots) | set(self._offered())

    def steps(self, generation: int | None = None) -> list[int]:
        """The steps held, newest first, for a reader of lease ``generation``
        (:meth:`_reader`)."""
        if not self._reader(generation, "a read of the steps held"):
            return []
        return sorted(self._held(), reverse=True)

    def keys(self, generation: int | None = None) -> list[tuple[int, int]]:
        """(lease generation of its writer, step) of each snapshot held, newest first in the
        run's order -- as storage orders its checkpoints (:mod:`ftjob.storage.catalog`) -- for
        a reader of lease ``generation`` (:meth:`_reader`). 0: a writer of no known generation
        (a run without a lease)."""
        if not self._reader(generation, "a read of the steps held"):
            return []
        born = {step: self.born.get(step) or 0 for step in self.snapshots}
        for step, entry in self._offered().items():
            born.setdefault(step, entry.generation)
        return sorted(((g, step) for step, g in born.items()), reverse=True)

    def get(self, step: int, generation: int | None = None) -> Any:
        """The snapshot of ``step`` (None: not held): a :class:`RingRef` when it lies in the
        ring, else the snapshot (as a Ray actor, its ObjectRef)."""
        if not self._reader(generation, f"a read of step {step}"):
            return None
        if step in self.snapshots:
            return self.snapshots[step]
        entry = self._offered().get(step)
        if self.ring is not None and entry is not None:
            return RingRef(self.ring.address, step, entry.nonce)
        return None

    def copy(self, step: int, generation: int | None = None) -> Any:
        """A copy of the ring's snapshot of ``step``, for a reader that cannot map the ring
        (as a Ray actor, an ObjectRef to it), or None."""
        if not self._reader(generation, f"a read of step {step}"):
            return None
        entry = self._offered().get(step)
        snapshot = None
        if self.ring is not None and entry is not None:
            snapshot = self.ring.read(step, entry.nonce)
        if snapshot is None:
            return None
        if self.object_store:
            import ray

            return ray.put(snapshot)
        return snapshot.own()

    def discard(self, step: int, generation: int | None = None) -> Refused | None:
        """A snapshot that failed verification: never offered again."""
        refused = self._admit(generation, f"the discard of step {step}")
        if refused is None:
            self._drop(step)
        return refused

    def drop_after(self, step: int, generation: int | None = None) -> list[int] | Refused:
        """The run restored ``step``: snapshots of later steps belong to the attempt that was
        lost (kept, they would be restored instead of the new attempt's, and evicted first),
        those the fence does not offer included."""
        refused = self._admit(generation, f"the drop of the steps after {step}")
        if refused is not None:
            return refused
        self.parts = {s: part for s, part in self.parts.items() if s <= step}
        ring = set(self.ring.committed()) if self.ring is not None else set()
        return [self._drop(s) for s in sorted(set(self.snapshots) | ring) if s > step]

    def stats(self) -> dict[str, Any]:
        taken, dropped = self.ring.counts() if self.ring else (0, 0)
        return {
            "held": self.steps(),
            "held_mb": self.held_bytes() / 2**20,
            "taken": self.taken + taken,
            "dropped": self.dropped + dropped,
            "generation": self.gate.generation,  # the run's lease generation, as told
            "refused": self.gate.refused,  # writes of an older generation
            **self.settings(),
        }

    def traffic(self) -> HolderTraffic:
        """What reached the holder over its life: the ring's snapshots (their count, at the
        size of the newest held: a run's snapshots are one size), what came by call, and the
        writes it refused."""
        received = self.received.with_refused(self.gate.refused)
        if self.ring is None:
            return received
        count, held = self.ring.counts()[0], self.ring.committed()
        newest = self.ring.read(max(held)) if held else None
        return received.with_in_place(count, count * newest.nbytes if newest else 0)


class NodeHolder(SnapshotHolder):
    """A node's holder as a detached Ray actor (:mod:`ftjob.memory.cluster`): it
    outlives the driver that started it, so the next driver of the run finds its snapshots;
    a thread releases it and ends the actor once no driver claimed it for
    ``orphan_timeout_s``."""

    def __init__(self, cap_bytes: int, keep: int, orphan_timeout_s: float) -> None:
        super().__init__(cap_bytes, keep, True, orphan_timeout_s)
        self.ended = threading.Event()
        threading.Thread(target=self._reap, name="ftjob-orphan", daemon=True).start()

    def _every(self) -> float:
        """How often the reaper looks: several times within the orphan time (as it is now: a
        resumed run's driver may have set another, :meth:`configure`)."""
        return min(max((self.orphan_timeout_s or 0) / 4, 0.5), 30.0)

    def _reap(self) -> None:
        import ray

        while not self.ended.wait(self._every()):
            if self.orphaned():
                self.release()
                ray.kill(ray.get_runtime_context().current_actor)
                return


# A holder's handle (a Ray actor, or a DirectHandle in one process); its calls are checked
# against SnapshotHolder's methods (ftjob.actors).
HolderHandle = Actor[SnapshotHolder]


def start_holder(cap_mb: float, keep: int) -> HolderHandle:
    """The run's holder as a Ray actor on this (the driver's) node, owned by the driver;
    pinned there, as the run ledger is: placed elsewhere, it could die with a worker node."""
    return start_pinned_actor(SnapshotHolder, int(cap_mb * 2**20), keep, True)


__all__ = [
    "HolderHandle",
    "NodeHolder",
    "PutAnswer",
    "Refused",
    "RingRef",
    "SnapshotHolder",
    "start_holder",
]
