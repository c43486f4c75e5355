"""The memory tier: snapshots of the training state, held in memory by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

A :class:`Snapshot` holds what a durable checkpoint holds (model, optimizer, training state) as
named buffers -- small ones as ``bytes``, the tensors' bytes as flat ``uint8`` numpy arrays,
which Ray moves without serialising and hands out of its object store without a copy -- each
with its SHA-256 digest; a snapshot is only trusted when every buffer verifies. The
:class:`SnapshotHolder` keeps the newest ones within a count and a byte cap. In a run it is a
Ray actor owned by the driver and placed on the driver's node (not a worker's: the object
would die with its owner), so a worker's death or the loss of a worker's node leaves it; when
the driver dies the tier is gone and resuming reads storage. Snapshots never replace durable
checkpoints: a run's final checkpoint is always a durable one.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Buffer = bytes | np.ndarray  # a flat uint8 array when it is one


def digest(data: Buffer) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def digest_all(files: dict[str, Buffer]) -> dict[str, str]:
    """Every buffer's digest; hashlib releases the GIL over large buffers, so a large state's
    arrays are hashed on every core at once (a small one's in this thread: cheaper)."""
    if sum(memoryview(data).nbytes for data in files.values()) < 16 * 2**20:
        return {name: digest(data) for name, data in files.items()}
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        return dict(zip(files, pool.map(digest, files.values()), strict=True))


@dataclass(frozen=True)
class Snapshot:
    """The buffers of a checkpoint of ``step``, in memory, with their digests."""

    step: int
    files: dict[str, Buffer]
    digests: dict[str, str]
    taken: float = field(default_factory=time.time)

    @classmethod
    def of(cls, step: int, files: dict[str, Buffer]) -> Snapshot:
        return cls(step, files, digest_all(files))

    @property
    def nbytes(self) -> int:
        return sum(memoryview(data).nbytes for data in self.files.values())

    def verify(self) -> str | None:
        """None when every buffer matches its digest, else what does not."""
        if set(self.files) != set(self.digests):
            return f"files {sorted(self.files)} do not match the digests' {sorted(self.digests)}"
        for name, found in digest_all(self.files).items():
            if found != self.digests[name]:
                return f"{name} does not match its sha256"
        return None

    def own(self) -> Snapshot:
        """This snapshot with arrays of its own: arrays that arrive through Ray are views of
        the object store's copy, which the sender owns and which would go with it."""
        files = {n: np.array(d) if isinstance(d, np.ndarray) else d for n, d in self.files.items()}
        return Snapshot(self.step, files, self.digests, self.taken)


class SnapshotHolder:
    """The newest snapshots of a run, at most ``keep`` and ``cap_bytes`` together. A snapshot
    bigger than the cap is refused (the caller turns the tier off); older ones are dropped to
    make room for a newer one."""

    def __init__(self, cap_bytes: int, keep: int, object_store: bool = False) -> None:
        self.cap_bytes, self.keep, self.object_store = cap_bytes, keep, object_store
        self.snapshots: dict[int, Any] = {}  # step -> its Snapshot, or its ObjectRef
        self.sizes: dict[int, int] = {}
        self.taken = self.dropped = 0

    def put(self, snapshot: Snapshot) -> dict[str, Any]:
        """Keep ``snapshot``: ``{"kept": True, "dropped": [steps]}``, or ``{"kept": False,
        "reason": ...}`` when it cannot fit under the cap. As a Ray actor (``object_store``)
        it keeps its copy in Ray's object store, owned by itself: a reader on this node maps
        it without a copy."""
        if snapshot.nbytes > self.cap_bytes:
            return {
                "kept": False,
                "reason": f"a snapshot of {snapshot.nbytes / 2**20:.0f} MB does not fit in "
                f"{self.cap_bytes / 2**20:.0f} MB",
            }
        if self.object_store:
            import ray

            self.snapshots[snapshot.step] = ray.put(snapshot)
        else:
            self.snapshots[snapshot.step] = snapshot.own()
        self.sizes[snapshot.step] = snapshot.nbytes
        self.taken += 1
        dropped = []
        while len(self.snapshots) > self.keep or self.held_bytes() > self.cap_bytes:
            dropped.append(self._drop(min(self.snapshots)))
        self.dropped += len(dropped)
        return {"kept": True, "dropped": dropped}

    def _drop(self, step: int) -> int:
        self.snapshots.pop(step, None)
        self.sizes.pop(step, None)
        return step

    def held_bytes(self) -> int:
        return sum(self.sizes[step] for step in self.snapshots)

    def steps(self) -> list[int]:
        """The steps held, newest first."""
        return sorted(self.snapshots, reverse=True)

    def get(self, step: int) -> Any:
        """The snapshot of ``step`` (None: not held), or as a Ray actor its ObjectRef."""
        return self.snapshots.get(step)

    def discard(self, step: int) -> None:
        """A snapshot that failed verification: never offered again."""
        self._drop(step)

    def drop_after(self, step: int) -> list[int]:
        """The run restored ``step``: snapshots of later steps belong to the attempt that was
        lost (kept, they would be restored instead of the new attempt's, and evicted first)."""
        return [self._drop(s) for s in sorted(self.snapshots) if s > step]

    def stats(self) -> dict[str, Any]:
        return {
            "held": self.steps(),
            "held_mb": self.held_bytes() / 2**20,
            "taken": self.taken,
            "dropped": self.dropped,
        }


def start_holder(cap_mb: float, keep: int) -> Any:
    """The run's holder as a Ray actor on this (the driver's) node, owned by the driver."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_restarts=0)(SnapshotHolder)
    # Pinned (soft=False, as the run ledger): placed elsewhere, it could die with a worker node.
    strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return actor.options(scheduling_strategy=strategy).remote(int(cap_mb * 2**20), keep, True)


__all__ = ["Buffer", "Snapshot", "SnapshotHolder", "digest", "digest_all", "start_holder"]
