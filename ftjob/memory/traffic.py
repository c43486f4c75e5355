"""What reached one snapshot holder over a run, by the way it came: the bytes a cluster's
network carries for the memory tier, counted where they land.

- **in place**: snapshots its node's writer (the node's lowest rank) put into the holder's
  shared-memory ring -- on the holder's own machine, no network;
- **sent**: whole snapshots sent to it through Ray (a writer on another machine, or a peer's
  copy a restore brought to a node whose holder had none);
- **parts**: rank 0's own part of a snapshot another rank of this node wrote (module
  buffers, per-rank records), sent by rank 0 with each snapshot it takes.

And what it refused: writes of a worker whose driver no longer holds the run
(:mod:`ftjob.memory.fence`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class HolderTraffic:
    """One holder's counters (bytes as the snapshots' own sizes: the files they carry)."""

    in_place: int = 0
    in_place_bytes: int = 0
    sent: int = 0
    sent_bytes: int = 0
    parts: int = 0
    part_bytes: int = 0
    refused: int = 0  # writes of an older lease generation than the holder's fence

    def add_sent(self, nbytes: int) -> HolderTraffic:
        return dataclasses.replace(self, sent=self.sent + 1, sent_bytes=self.sent_bytes + nbytes)

    def add_part(self, nbytes: int) -> HolderTraffic:
        return dataclasses.replace(self, parts=self.parts + 1, part_bytes=self.part_bytes + nbytes)

    def with_in_place(self, count: int, nbytes: int) -> HolderTraffic:
        return dataclasses.replace(self, in_place=count, in_place_bytes=nbytes)

    def with_refused(self, count: int) -> HolderTraffic:
        return dataclasses.replace(self, refused=count)

    @property
    def received_bytes(self) -> int:
        """Bytes that reached the holder from another process through Ray: on a cluster, what
        may cross the network (a writer on the holder's machine reaches it in place)."""
        return self.sent_bytes + self.part_bytes


@dataclass(frozen=True)
class RunTraffic:
    """Every holder's counters, and what they add up to per snapshot rank 0 took."""

    holders: tuple[HolderTraffic, ...]
    snapshots: int  # taken by rank 0 (written in place into its node's holder)
    snapshot_bytes: int  # one snapshot's bytes, as its node's writer put it in place

    @classmethod
    def of(cls, holders: list[HolderTraffic]) -> RunTraffic:
        written = [h for h in holders if h.in_place]
        snapshots = max((h.in_place for h in written), default=0)
        size = max((h.in_place_bytes // h.in_place for h in written), default=0)
        return cls(tuple(holders), snapshots, size)

    @property
    def between_nodes_per_snapshot(self) -> float:
        """Bytes sent to holders through Ray per snapshot: rank 0's parts to the peers, and any
        whole snapshot sent (0 where no snapshot was taken)."""
        received = sum(h.received_bytes for h in self.holders)
        return received / self.snapshots if self.snapshots else 0.0

    @property
    def refused(self) -> int:
        """Writes the holders refused: a deposed driver's workers'."""
        return sum(h.refused for h in self.holders)

    @property
    def part_bytes(self) -> float:
        """The per-rank part's size (one peer's share, per part it received)."""
        parts = sum(h.parts for h in self.holders)
        return sum(h.part_bytes for h in self.holders) / parts if parts else 0.0

    def line(self) -> str:
        """The run's memory-tier traffic as the driver says it at the end."""
        nodes = len(self.holders)
        return (
            f"memory tier: {self.snapshots} snapshot(s) of {self.snapshot_bytes / 2**20:.4f} MB "
            f"written in place on each of {nodes} node(s); between nodes "
            f"{self.between_nodes_per_snapshot:.0f} B per snapshot (rank 0's part: "
            f"{self.part_bytes:.0f} B to each peer)"
        )


__all__ = ["HolderTraffic", "RunTraffic"]
