"""Reading a memory snapshot from the nearest holder that has it, verified: this node's, else a
surviving peer's (one transfer), which then fills this node's holder (a replaced node's, an
empty one). Rank 0 finds the newest held snapshot newer than storage (:meth:`NearestCopy.newest`);
every other rank reads the same one (:meth:`NearestCopy.chosen`). Its writes to a holder (a
peer's copy kept here, drops, discards) and its reads carry its driver's lease generation, as
a snapshot's do (:mod:`ftjob.memory.fence`): a holder no driver fenced moves its fence
on at this rank's first read, and offers it nothing a deposed driver's workers wrote. The holders:
:mod:`ftjob.memory.cluster`; taking snapshots: :mod:`ftjob.memory.tier`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftjob.actors import Fetch, call
from ftjob.memory.fence import Refused
from ftjob.memory.format import Snapshot
from ftjob.memory.holder import HolderHandle, RingRef, SnapshotHolder
from ftjob.memory.node_holders import NodeHolders, rank_part, written_by
from ftjob.memory.ring import Ring
from ftjob.record import Holder


def holder_errors() -> tuple[type[BaseException], ...]:
    """What a call to a holder that is gone raises: Ray's errors (a dead actor, a lost
    object), or a connection's (the local harness's manager)."""
    import ray.exceptions

    return (ray.exceptions.RayError, ConnectionError, EOFError)


class NearestCopy:
    """Rank ``rank``'s reads of the run's holders (``place``; ``holder``: its node's handle).
    ``attach(address)`` maps a holder's ring where this process can (same machine), else None;
    ``fetch`` resolves a holder's answers. After a read, ``source`` says whose copy it was
    (local or peer) and ``node_read`` that holder's node; ``refused``, why a holder refused
    a write of this rank's (its driver's lease generation, ``place.generation``, is older
    than the holder's)."""

    def __init__(
        self,
        place: NodeHolders,
        holder: HolderHandle | None,
        rank: int,
        fetch: Fetch,
        log: Callable[[str], None],
        attach: Callable[[dict[str, Any]], Ring | None],
    ) -> None:
        self.place, self.holder, self.rank = place, holder, rank
        self.generation = place.generation
        self.refused: str | None = None
        self.fetch, self.log, self.attach = fetch, log, attach
        self.source, self.node_read = Holder.storage, place.node

    def holders(self) -> list[tuple[str, HolderHandle]]:
        """This node's holder, then its peers' (none when they cannot be listed)."""
        try:
            peers = self.place.peers()
        except holder_errors() as exc:
            self.log(f"memory tier: the peer holders could not be listed ({exc})")
            peers = []
        here = [(self.place.node, self.holder)] if self.holder is not None else []
        return [*here, *peers]

    def drop_after(self, step: int) -> bool:
        """Every holder drops its snapshots past ``step``; False when this node's did not
        answer (a peer's may be gone with its node)."""
        answered = True
        for _, handle in self.holders():
            try:
                self._refused(
                    self.fetch(call(handle, SnapshotHolder.drop_after, step, self.generation))
                )
            except holder_errors():
                answered = answered and handle is not self.holder
        return answered

    def _refused(self, answer: object) -> None:
        if isinstance(answer, Refused):
            self.refused = answer.reason

    def newest(self, committed: Callable[[], list[tuple[int, int]]]) -> Snapshot | None:
        """Rank 0: the newest snapshot any holder has that is newer than every committed
        durable checkpoint and verifies -- this node's copy first, else a peer's; one that does
        not verify is dropped from its holder, with a line. Newer in the run's order, storage's
        (``committed()``: (lease generation, step) of the checkpoints, newest first): a
        snapshot of the live driver's generation outranks a deposed driver's later step."""
        held: dict[tuple[int, int], list[tuple[str, HolderHandle]]] = {}
        for node, handle in self.holders():
            try:
                for generation, step in self.fetch(
                    call(handle, SnapshotHolder.keys, self.generation)
                ):
                    held.setdefault((generation, step), []).append((node, handle))
            except holder_errors() as exc:
                self.log(f"memory tier: the holder of node {node[:12]} did not answer ({exc})")
        durable = committed() if held else []
        for key in sorted(held, reverse=True):
            if durable and key <= durable[0]:
                return None
            step = key[1]
            for node, handle in held[key]:
                snapshot = self.complete(self.get(step, handle), handle)
                if snapshot is not None:
                    self._keep_here(node, snapshot)
                    return snapshot
        return None

    def chosen(self, step: int, digests: dict[str, str], node: str | None = None) -> Snapshot:
        """Ranks > 0: their copy of the snapshot rank 0 chose (``digests``: rank 0's; ``node``:
        the holder it read), verified and the same one -- this node's, else the one rank 0
        read, else another peer's (else raises: the attempt fails, and the next one reads
        storage): every rank loads the same state."""
        holders = sorted(self.holders(), key=lambda h: (h[1] is not self.holder, h[0] != node))
        for where, handle in holders:
            snapshot = self.complete(self.get(step, handle), handle)
            if snapshot is not None and snapshot.digests == digests:
                self._keep_here(where, snapshot)
                return snapshot
        raise RuntimeError(
            f"rank {self.rank}: the memory snapshot of step {step} rank 0 chose does not "
            "verify here, or is another one"
        )

    def complete(self, snapshot: Snapshot | None, holder: HolderHandle) -> Snapshot | None:
        """``snapshot`` as the run's state: as it is when rank 0 wrote it (or it has no
        per-rank part), else with rank 0's own part of its step in place of its writer's
        (from ``holder``, to which rank 0 sent it); None when that part is not held (rank 0
        did not take this step) or does not verify."""
        if snapshot is None or written_by(snapshot.files) in (0, None):
            return snapshot
        try:
            part = self.fetch(call(holder, SnapshotHolder.part, snapshot.step, self.generation))
        except holder_errors():
            return None
        if part is None or part.verify() is not None:
            return None
        files = {n: d for n, d in snapshot.files.items() if n not in rank_part(snapshot.files)}
        digests = {n: snapshot.digests[n] for n in files}
        return Snapshot(
            snapshot.step, {**files, **part.files}, {**digests, **part.digests}, snapshot.taken
        )

    def _keep_here(self, node: str, snapshot: Snapshot) -> None:
        """``snapshot`` came from ``node``'s holder: said in the restore record (local or
        peer); a copy from a peer fills this node's holder (a replaced node's, an empty one)."""
        self.node_read = node
        self.source = Holder.local if node == self.place.node else Holder.peer
        if self.source == Holder.peer and self.holder is not None:
            try:
                self.fetch(call(self.holder, SnapshotHolder.put, snapshot, self.generation))
            except holder_errors():
                pass  # this node's holder is gone: the next restore reads a peer's again

    def get(self, step: int, holder: HolderHandle | None = None) -> Snapshot | None:
        """The snapshot of ``step`` in ``holder`` (this node's by default) if it verifies (else
        dropped from the holder, said); None, quietly, where it holds none."""
        holder = self.holder if holder is None else holder
        if holder is None:  # this node has no holder
            return None
        try:
            snapshot, why = (
                self.fetch(call(holder, SnapshotHolder.get, step, self.generation)),
                None,
            )
        except holder_errors():
            return None  # a peer's holder gone with its node
        if snapshot is None:
            return None
        if isinstance(snapshot, RingRef):
            snapshot = self._read_ring(snapshot, holder)
        if snapshot is not None and not isinstance(snapshot, Snapshot):
            try:  # its ObjectRef: read from Ray's object store
                snapshot = self.fetch(snapshot)
            except holder_errors() as exc:  # the object is lost (its node, its owner)
                snapshot, why = None, f"{type(exc).__name__}: {exc}"
        why = why or ("it is no longer held" if snapshot is None else snapshot.verify())
        if why is None:
            return snapshot
        self._refused(self.fetch(call(holder, SnapshotHolder.discard, step, self.generation)))
        self.log(f"memory snapshot of step {step} is not usable ({why}): skipped")
        return None

    def _read_ring(self, ref: RingRef, holder: HolderHandle) -> Any:
        """A snapshot in a holder's ring: read in place where this process can map the
        ring (its arrays are the ring's memory: loaded before the next snapshot is written),
        else a copy from the holder (a peer on another machine: one transfer)."""
        ring = self.attach(ref.address)
        if ring is not None:
            return ring.read(ref.step, ref.nonce)
        return self.fetch(call(holder, SnapshotHolder.copy, ref.step, self.generation))


__all__ = ["NearestCopy", "holder_errors"]
