"""The memory tier: snapshots of the training state, held in memory by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

A :class:`Snapshot` holds the same files a durable checkpoint holds (model, optimizer, training
state), each with its SHA-256 digest; a snapshot is only trusted when every file verifies. The
:class:`SnapshotHolder` keeps the newest ones within a count and a byte cap. In a run it is a
Ray actor owned by the driver and placed on the driver's node (not a worker's: the object
would die with its owner), so a worker's death or the loss of a worker's node leaves it; when
the driver dies the tier is gone and resuming reads storage. Snapshots never replace durable
checkpoints: a run's final checkpoint is always a durable one.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """The files of a checkpoint of ``step``, in memory, with their digests."""

    step: int
    files: dict[str, bytes]
    digests: dict[str, str]
    taken: float = field(default_factory=time.time)

    @classmethod
    def of(cls, step: int, files: dict[str, bytes]) -> Snapshot:
        return cls(step, files, {name: digest(data) for name, data in files.items()})

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    def verify(self) -> str | None:
        """None when every file matches its digest, else what does not."""
        if set(self.files) != set(self.digests):
            return f"files {sorted(self.files)} do not match the digests' {sorted(self.digests)}"
        for name, data in self.files.items():
            if digest(data) != self.digests[name]:
                return f"{name} does not match its sha256"
        return None


class SnapshotHolder:
    """The newest snapshots of a run, at most ``keep`` and ``cap_bytes`` together. A snapshot
    bigger than the cap is refused (the caller turns the tier off); older ones are dropped to
    make room for a newer one."""

    def __init__(self, cap_bytes: int, keep: int) -> None:
        self.cap_bytes, self.keep = cap_bytes, keep
        self.snapshots: dict[int, Snapshot] = {}
        self.taken = self.dropped = 0

    def put(self, snapshot: Snapshot) -> dict[str, Any]:
        """Keep ``snapshot``: ``{"kept": True, "dropped": [steps]}``, or ``{"kept": False,
        "reason": ...}`` when it cannot fit under the cap."""
        if snapshot.nbytes > self.cap_bytes:
            return {
                "kept": False,
                "reason": f"a snapshot of {snapshot.nbytes / 2**20:.0f} MB does not fit in "
                f"{self.cap_bytes / 2**20:.0f} MB",
            }
        self.snapshots[snapshot.step] = snapshot
        self.taken += 1
        dropped = []
        while len(self.snapshots) > self.keep or self.held_bytes() > self.cap_bytes:
            oldest = min(self.snapshots)
            del self.snapshots[oldest]
            dropped.append(oldest)
        self.dropped += len(dropped)
        return {"kept": True, "dropped": dropped}

    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots.values())

    def steps(self) -> list[int]:
        """The steps held, newest first."""
        return sorted(self.snapshots, reverse=True)

    def get(self, step: int) -> Snapshot | None:
        return self.snapshots.get(step)

    def discard(self, step: int) -> None:
        """A snapshot that failed verification: never offered again."""
        self.snapshots.pop(step, None)

    def drop_after(self, step: int) -> list[int]:
        """The run restored ``step``: snapshots of later steps belong to the attempt that was
        lost (kept, they would be restored instead of the new attempt's, and evicted first)."""
        later = [s for s in self.snapshots if s > step]
        for s in later:
            del self.snapshots[s]
        return later

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
    return actor.options(scheduling_strategy=strategy).remote(int(cap_mb * 2**20), keep)


__all__ = ["Snapshot", "SnapshotHolder", "digest", "start_holder"]
