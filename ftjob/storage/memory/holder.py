"""The memory tier's holder: the newest snapshots of a run, kept by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

In a run the :class:`SnapshotHolder` is a Ray actor owned by the driver and placed on the
driver's node (not a worker's: the object would die with its owner), so a worker's death or the
loss of a worker's node leaves it; when the driver dies the tier is gone and resuming reads
storage. A rank on the holder's machine writes its snapshots into the holder's shared-memory
:class:`~ftjob.storage.memory.ring.Ring` (no call per snapshot); a rank elsewhere sends each one
through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftjob.placement import start_pinned_actor
from ftjob.storage.memory.format import Snapshot
from ftjob.storage.memory.ring import Ring, machine


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

    def __init__(self, cap_bytes: int, keep: int, object_store: bool = False) -> None:
        self.cap_bytes, self.keep, self.object_store = cap_bytes, keep, object_store
        self.snapshots: dict[int, Any] = {}  # step -> its Snapshot, or its ObjectRef
        self.sizes: dict[int, int] = {}
        self.taken = self.dropped = 0
        self.ring: Ring | None = None

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
        it without a copy."""
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

    def _drop(self, step: int) -> int:
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
        return [self._drop(s) for s in sorted(self._held()) if s > step]

    def stats(self) -> dict[str, Any]:
        taken, dropped = self.ring.counts() if self.ring else (0, 0)
        return {
            "held": self.steps(),
            "held_mb": self.held_bytes() / 2**20,
            "taken": self.taken + taken,
            "dropped": self.dropped + dropped,
        }


def start_holder(cap_mb: float, keep: int) -> Any:
    """The run's holder as a Ray actor on this (the driver's) node, owned by the driver;
    pinned there, as the run ledger is: placed elsewhere, it could die with a worker node."""
    return start_pinned_actor(SnapshotHolder, int(cap_mb * 2**20), keep, True)


__all__ = ["RingRef", "SnapshotHolder", "start_holder"]
