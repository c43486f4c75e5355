"""The memory tier's holder: the newest snapshots of a run, kept by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

In a run each node that runs training ranks has one, a :class:`NodeHolder`: a detached Ray
actor pinned to its node and named by the run (:mod:`ftjob.storage.memory.cluster`), so a
worker's death leaves it, the loss of a node leaves the other nodes', and a driver's death leaves
them all where the cluster lives on. A rank on the holder's machine writes its snapshots into the
holder's shared-memory :class:`~ftjob.storage.memory.ring.Ring` (no call per snapshot); a rank
elsewhere sends each one through Ray. (:func:`start_holder`: one holder owned by this process,
on its node, for measurements.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.placement import start_pinned_actor
from ftjob.storage.memory.format import Snapshot
from ftjob.storage.memory.ring import Ring, machine
from ftjob.storage.memory.traffic import HolderTraffic


@dataclass(frozen=True)
class RingRef:
    """The holder's answer for a snapshot that lies in its ring: where to map it. A reader
    that cannot (another machine) asks the holder for a copy (``SnapshotHolder.copy``)."""

    address: dict[str, Any]
    step: int


class SnapshotHolder:
    """The newest snapshots of a run, at most ``keep`` and ``cap_bytes`` together. A snapshot
    bigger than the cap is refused (the caller turns the tier off); older ones are dropped to
    make room for a newer one.

    Snapshots arrive two ways. A rank on the holder's machine writes them into the holder's
    :class:`Ring` (:meth:`channel` creates it once, ``keep + 1`` slots within the cap) with no
    call per snapshot; any other rank sends each one (:meth:`put`). Both are listed, offered
    and dropped alike."""

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

    def release(self) -> None:
        """Every snapshot and the ring let go (the run ended, or no driver claims it)."""
        for step in list(self.snapshots):
            self._drop(step)
        self.parts.clear()
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def channel(self, slot_bytes: int, where: str) -> dict[str, Any] | None:
        """The ring's address for a writer on machine ``where`` (:func:`machine`) whose
        snapshots take at most ``slot_bytes`` (creating the ring the first time), or None:
        the writer sends them (:meth:`put`). None for a writer on another machine, when
        ``keep + 1`` such slots do not fit in the cap, when the ring has smaller slots, or
        where there is no shared memory to make one."""
        if not where or where != machine():
            return None
        if self.ring is None:
            slots = self.keep + 1  # the newest `keep`, and the one being written
            if Ring.size(slots, slot_bytes) > self.cap_bytes - self._sent_bytes():
                return None
            try:
                self.ring = Ring.create(slots, slot_bytes)
            except (OSError, AttributeError):  # no memfd here (AttributeError: not Linux)
                return None
        return self.ring.address if slot_bytes <= self.ring.slot_bytes else None

    def put(self, snapshot: Snapshot) -> dict[str, Any]:
        """Keep ``snapshot``: ``{"kept": True, "dropped": [steps]}``, or ``{"kept": False,
        "reason": ...}`` when it cannot fit under the cap. As a Ray actor (``object_store``)
        it keeps its copy in Ray's object store, owned by itself: a reader on this node maps
        it without a copy. A step already held is kept as it is (a copy from a peer that
        another rank of this node put first)."""
        self.received = self.received.add_sent(snapshot.nbytes)
        if snapshot.step in self._held():
            return {"kept": True, "dropped": []}
        room = self.cap_bytes - self._ring_bytes()
        if snapshot.nbytes > room and self.ring is not None and not self.ring.counts()[0]:
            self.ring.close()  # made for a writer that never wrote into it: its room back
            self.ring, room = None, self.cap_bytes
        if snapshot.nbytes > room:
            return {
                "kept": False,
                "reason": f"a snapshot of {snapshot.nbytes / 2**20:.0f} MB does not fit in "
                f"{room / 2**20:.0f} MB",
            }
        if self.object_store:
            import ray

            self.snapshots[snapshot.step] = ray.put(snapshot)
        else:
            self.snapshots[snapshot.step] = snapshot.own()
        self.sizes[snapshot.step] = snapshot.nbytes
        self.taken += 1
        dropped = []
        while len(self.snapshots) > self.keep or self._sent_bytes() > room:
            dropped.append(self._drop(min(self.snapshots)))
        self.dropped += len(dropped)
        return {"kept": True, "dropped": dropped}

    def put_part(self, part: Snapshot) -> None:
        """Rank 0's own part of its snapshot of ``part.step`` (its module's buffers, its
        records: small), which completes this node's copy of that step, written by another
        rank. The newest ``keep + 1`` are kept."""
        self.received = self.received.add_part(part.nbytes)
        self.parts[part.step] = part.own()
        for step in sorted(self.parts)[: -(self.keep + 1)]:
            del self.parts[step]

    def part(self, step: int) -> Snapshot | None:
        return self.parts.get(step)

    def _drop(self, step: int) -> int:
        self.parts.pop(step, None)
        self.snapshots.pop(step, None)
        self.sizes.pop(step, None)
        if self.ring is not None:
            self.ring.drop(step)
        return step

    def _sent_bytes(self) -> int:
        return sum(self.sizes[step] for step in self.snapshots)

    def held_bytes(self) -> int:
        """The snapshots sent, and the whole ring (its memory is taken when it is made)."""
        return self._sent_bytes() + self._ring_bytes()

    def _ring_bytes(self) -> int:
        return self.ring.nbytes if self.ring is not None else 0

    def _held(self) -> set[int]:
        return set(self.snapshots) | (set(self.ring.committed()) if self.ring else set())

    def steps(self) -> list[int]:
        """The steps held, newest first."""
        return sorted(self._held(), reverse=True)

    def get(self, step: int) -> Any:
        """The snapshot of ``step`` (None: not held): a :class:`RingRef` when it lies in the
        ring, else the snapshot (as a Ray actor, its ObjectRef)."""
        if step in self.snapshots:
            return self.snapshots[step]
        if self.ring is not None and step in self.ring.committed():
            return RingRef(self.ring.address, step)
        return None

    def copy(self, step: int) -> Any:
        """A copy of the ring's snapshot of ``step``, for a reader that cannot map the ring
        (as a Ray actor, an ObjectRef to it), or None."""
        snapshot = self.ring.read(step) if self.ring is not None else None
        if snapshot is None:
            return None
        if self.object_store:
            import ray

            return ray.put(snapshot)
        return snapshot.own()

    def discard(self, step: int) -> None:
        """A snapshot that failed verification: never offered again."""
        self._drop(step)

    def drop_after(self, step: int) -> list[int]:
        """The run restored ``step``: snapshots of later steps belong to the attempt that was
        lost (kept, they would be restored instead of the new attempt's, and evicted first)."""
        self.parts = {s: part for s, part in self.parts.items() if s <= step}
        return [self._drop(s) for s in sorted(self._held()) if s > step]

    def stats(self) -> dict[str, Any]:
        taken, dropped = self.ring.counts() if self.ring else (0, 0)
        return {
            "held": self.steps(),
            "held_mb": self.held_bytes() / 2**20,
            "taken": self.taken + taken,
            "dropped": self.dropped + dropped,
        }

    def traffic(self) -> HolderTraffic:
        """What reached the holder over its life: the ring's snapshots (their count, at the
        size of the newest held: a run's snapshots are one size), and what came by call."""
        if self.ring is None:
            return self.received
        count, held = self.ring.counts()[0], self.ring.committed()
        newest = self.ring.read(max(held)) if held else None
        return self.received.with_in_place(count, count * newest.nbytes if newest else 0)


class NodeHolder(SnapshotHolder):
    """A node's holder as a detached Ray actor (:mod:`ftjob.storage.memory.cluster`): it
    outlives the driver that started it, so the next driver of the run finds its snapshots;
    a thread releases it and ends the actor once no driver claimed it for
    ``orphan_timeout_s``."""

    def __init__(self, cap_bytes: int, keep: int, orphan_timeout_s: float) -> None:
        super().__init__(cap_bytes, keep, True, orphan_timeout_s)
        every, self.ended = min(max(orphan_timeout_s / 4, 0.5), 30.0), threading.Event()
        threading.Thread(target=self._reap, args=(every,), name="ftjob-orphan", daemon=True).start()

    def _reap(self, every: float) -> None:
        import ray

        while not self.ended.wait(every):
            if self.orphaned():
                self.release()
                ray.kill(ray.get_runtime_context().current_actor)
                return


def start_holder(cap_mb: float, keep: int) -> Any:
    """The run's holder as a Ray actor on this (the driver's) node, owned by the driver;
    pinned there, as the run ledger is: placed elsewhere, it could die with a worker node."""
    return start_pinned_actor(SnapshotHolder, int(cap_mb * 2**20), keep, True)


__all__ = ["NodeHolder", "RingRef", "SnapshotHolder", "start_holder"]
