"""The memory tier (``checkpoint.memory``): the newest training state held in memory outside
the training processes, so a restart restores from memory what storage would give seconds
later and several steps older. It never replaces durable checkpoints: a run's final checkpoint
is always a durable one. This package is the tier whole -- its protocol, the worker's side and
the driver's -- in a layer of its own, above storage and policy, which it is built from (the
run's identity, a restore's choice, the snapshot cadence), and below the worker and the driver,
which call it (docs/ARCHITECTURE.md).

**What a snapshot is** (:mod:`ftjob.memory.format`). A step's state as a durable checkpoint
holds it -- the model's weights and buffers, the optimizer's state, the training state, the
config -- as named buffers: each state dict as its skeleton (its structure, a marker for each
tensor) and one flat array of its tensors' bytes, a dtype's tensors back to back; the records
as JSON. Every buffer carries its digest (XXH3-128); a snapshot is trusted only when every one
verifies.

**Who writes it, and where** (:mod:`ftjob.memory.tier`, :mod:`ftjob.memory.snapshot_copy`,
:mod:`ftjob.memory.snapshot_writer`, :mod:`ftjob.memory.node_holders`). Every
``every_n_steps`` steps each node's lowest rank takes one: the training thread takes the
module's buffers (the next forward pass changes them), the tier's thread copies the weights and
the optimizer's state while the next step trains, and that step waits for the copy before its
``optimizer.step()``. The copy lands in a slot of its node's holder's shared-memory ring
(:mod:`ftjob.memory.ring`; :mod:`ftjob.memory.slots`: a slot is its writer's until it commits,
and no call is made per snapshot), or, from another machine, is sent through Ray. The holder
(:mod:`ftjob.memory.holder`) is a detached Ray actor on each node that runs ranks, named by the
run's identity (:mod:`ftjob.memory.cluster`): it outlives the workers and, where the cluster
lives on, the driver. What differs between the ranks' copies -- rank 0's module buffers and
per-rank records -- rank 0 sends to every peer holder with each snapshot, so every node holds a
whole copy of the run's state (what reached each holder: :mod:`ftjob.memory.traffic`).

**Who reads it** (:mod:`ftjob.memory.nearest_copy`). After a failure, rank 0 of the next attempt
takes the newest snapshot any holder has that is newer than storage's newest verified
checkpoint -- in the run's order, (lease generation, step), as storage orders its own -- from
its node's holder, else a peer's, completed with rank 0's part and verified; every other rank
reads the same one, known by its digests.

**What fences it** (:mod:`ftjob.memory.fence`). Every write to a holder carries the lease
generation of its writer's driver, and a driver that takes the run fences every holder with its
own before its workers start: from then on a deposed driver's workers are refused (the ring's
head carries the fence, checked at a claim and at a commit), what they committed before stays
restorable, and what slipped past the fence is never offered.

**How it is restored** (:meth:`ftjob.memory.tier.MemoryTier.offer`, ``files``). Rank 0
broadcasts its choice -- the step, the digests, the holder it read --, every rank loads the
same state dicts (:func:`ftjob.memory.node_holders.unpack_state`), and rank 0 drops the
snapshots past the restored step from every holder: they belong to the attempt that was lost.
A snapshot that does not verify is dropped with a line, and storage is read instead.

**The holders' life** (:mod:`ftjob.memory.lifecycle`, the driver's side): started on every node
that runs ranks, fenced, given this run's settings where they outlived the last driver, claimed
while the driver lives, released at the run's end -- or, when no driver claims them for
``orphan_timeout_s``, by themselves.

The worker calls :class:`~ftjob.memory.tier.MemoryTier` (from :mod:`ftjob.worker.loop` and
:mod:`ftjob.worker.checkpointer`), the driver :func:`~ftjob.memory.lifecycle.held_snapshots`
(from :mod:`ftjob.driver.runner`).
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
