"""The memory tier (``checkpoint.memory``): snapshots of the training state, held in memory by
a process that outlives the training workers, so a restart restores from memory what storage
would give seconds later and several steps older. Snapshots never replace durable checkpoints:
a run's final checkpoint is always a durable one.

- :mod:`~ftjob.memory.format`: a snapshot (named buffers, each with its XXH3-128
  digest, trusted only when every one verifies) and a state dict packed into its buffers.
- :mod:`~ftjob.memory.ring`: the holder's shared-memory ring, which a rank on its
  machine writes snapshots into with no call per snapshot; its slots' claims, commits and
  pruning, each fenced: :mod:`~ftjob.memory.slots`.
- :mod:`~ftjob.memory.holder`: the holder, a Ray actor on a node that keeps the
  newest snapshots within a count and a byte cap.
- :mod:`~ftjob.memory.cluster`: a holder on every node that runs training ranks,
  named by the run's identity (:mod:`ftjob.storage.identity`), outliving the driver where the
  cluster lives on.

A worker takes and restores them through :mod:`ftjob.memory.tier`.
"""

from ftjob.memory.format import (
    DIGEST,
    Buffer,
    Flat,
    Snapshot,
    digest,
    digest_all,
    pack,
    state_bytes,
    unpack,
)
from ftjob.memory.holder import RingRef, SnapshotHolder, start_holder
from ftjob.memory.ring import Arena, Ring
from ftjob.placement import machine

__all__ = [
    "DIGEST",
    "Arena",
    "Buffer",
    "Flat",
    "Ring",
    "RingRef",
    "Snapshot",
    "SnapshotHolder",
    "digest",
    "digest_all",
    "machine",
    "pack",
    "start_holder",
    "state_bytes",
    "unpack",
]
