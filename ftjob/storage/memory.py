"""The memory tier: snapshots of the training state, held in memory by a process that outlives
the training workers, so a restart restores from memory what storage would give seconds later
and several steps older.

A :class:`Snapshot` holds what a durable checkpoint holds (model, optimizer, training state) as
named buffers -- small ones as ``bytes``, the tensors' bytes as flat ``uint8`` numpy arrays --
each with its SHA-256 digest; a snapshot is only trusted when every buffer verifies. The
:class:`SnapshotHolder` keeps the newest ones within a count and a byte cap. In a run it is a
Ray actor owned by the driver and placed on the driver's node (not a worker's: the object
would die with its owner), so a worker's death or the loss of a worker's node leaves it; when
the driver dies the tier is gone and resuming reads storage. A rank on the holder's machine
writes its snapshots into the holder's shared-memory :class:`Ring` (no call per snapshot);
a rank elsewhere sends each one through Ray. Snapshots never replace durable checkpoints: a
run's final checkpoint is always a durable one.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import stat
import struct
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


def machine() -> str:
    """Which kernel and pid namespace this process runs in: two processes that agree can map
    each other's memory files through ``/proc/<pid>/fd``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


class Ring:
    """Snapshot slots in one block of shared memory: the channel from a rank to the holder on
    its machine that costs no call per snapshot (the Ray path costs an actor call carrying the
    snapshot and the holder's copy of it, each time).

    The holder creates it (:meth:`create`): an anonymous memory file (``memfd``) that exists
    only while a process maps it or holds it open -- nothing to clean up when the holder dies
    however it dies. A process on the same machine opens it through ``/proc/<holder>/fd/<n>``
    (:meth:`attach`) and checks the random token at its start: another machine, or another
    process behind the same pid (a container's), finds no token and uses the Ray path.

    Slot ``i``: a header -- its state, its step, then JSON naming each file's offset, length
    and digest -- and ``slot_bytes`` of payload. The writer marks a slot being written before
    it touches it and committed after every byte and the header are in, so a writer that dies
    half-way leaves a slot no reader takes; and a reader trusts a slot only when every file
    matches its digest. One writer at a time (the rank taking snapshots); a reader reads while
    no snapshot is being written (a restore, before training resumes)."""

    MAGIC = b"ftjob-snapshots1"
    TOKEN = 16
    HEAD = 64  # magic, token, taken, dropped
    SLOT_HEAD = 64 * 1024  # state, step, JSON length, JSON
    EMPTY, WRITING, COMMITTED = 0, 1, 2

    def __init__(self, memory: mmap.mmap, address: dict[str, Any], fd: int | None = None) -> None:
        self.memory, self.address, self.fd = memory, address, fd  # fd: the holder's, kept open
        self.slots, self.slot_bytes = address["slots"], address["slot_bytes"]

    @classmethod
    def size(cls, slots: int, slot_bytes: int) -> int:
        return cls.HEAD + slots * (cls.SLOT_HEAD + slot_bytes)

    @property
    def nbytes(self) -> int:
        return self.size(self.slots, self.slot_bytes)

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> Ring:
        """A new ring, its memory reserved now (a machine short of it says so here, not with a
        bus error in the middle of a snapshot). Raises OSError where there is no memfd."""
        slot_bytes = -(-slot_bytes // 64) * 64  # every payload starts 64-byte aligned
        size = cls.size(slots, slot_bytes)
        fd = os.memfd_create("ftjob-snapshots", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            memory = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        token = secrets.token_bytes(cls.TOKEN)
        memory[: len(cls.MAGIC) + cls.TOKEN] = cls.MAGIC + token
        address = {
            "path": f"/proc/{os.getpid()}/fd/{fd}",
            "token": token.hex(),
            "slots": slots,
            "slot_bytes": slot_bytes,
        }
        return cls(memory, address, fd)  # the fd kept open: the memory lives while the holder does

    @classmethod
    def attach(cls, address: dict[str, Any]) -> Ring | None:
        """The holder's ring, when this process can map it (same machine, and the token
        matches), else None."""
        if not re.fullmatch(r"/proc/\d+/fd/\d+", str(address.get("path"))):
            return None  # only a holder's memory file, never another path
        try:
            fd = os.open(address["path"], os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            size = cls.size(address["slots"], address["slot_bytes"])
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_size != size:
                return None
            memory = mmap.mmap(fd, size)
        except OSError:
            return None
        finally:
            os.close(fd)  # the mapping keeps the memory
        if memory[: len(cls.MAGIC) + cls.TOKEN] != cls.MAGIC + bytes.fromhex(address["token"]):
            memory.close()
            return None
        return cls(memory, address)

    def close(self) -> None:
        """The holder lets its ring go (its memory goes once no process maps it)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.memory.close()
        except BufferError:  # arrays still view it: the mapping goes with the last of them
            pass

    # -- counts and slot headers ------------------------------------------------------------

    def _count(self, which: int, add: int = 0) -> int:
        at = len(self.MAGIC) + self.TOKEN + 8 * which  # one writer: its rank
        value = struct.unpack_from("<Q", self.memory, at)[0] + add
        if add:
            struct.pack_into("<Q", self.memory, at, value)
        return value

    def counts(self) -> tuple[int, int]:
        """Snapshots committed and dropped over the ring's life."""
        return self._count(0), self._count(1)

    def _start(self, slot: int) -> int:
        return self.HEAD + slot * (self.SLOT_HEAD + self.slot_bytes)

    def _state(self, slot: int) -> tuple[int, int]:
        return struct.unpack_from("<QQ", self.memory, self._start(slot))  # type: ignore[return-value]

    def _set_state(self, slot: int, state: int, step: int = 0) -> None:
        struct.pack_into("<QQ", self.memory, self._start(slot), state, step)

    def committed(self) -> dict[int, int]:
        """Step -> slot of every committed snapshot."""
        held = {}
        for slot in range(self.slots):
            state, step = self._state(slot)
            if state == self.COMMITTED:
                held[step] = slot
        return held

    # -- writing ----------------------------------------------------------------------------

    def claim(self) -> tuple[int, np.ndarray]:
        """A slot to write the next snapshot into, marked as being written, and its payload:
        one not committed (the writer keeps at most ``slots - 1`` committed, :meth:`keep_newest`)."""
        held = set(self.committed().values())
        slot = next(s for s in range(self.slots) if s not in held)
        self._set_state(slot, self.WRITING)
        return slot, self.payload(slot)

    def payload(self, slot: int) -> np.ndarray:
        start = self._start(slot) + self.SLOT_HEAD
        return np.frombuffer(self.memory, np.uint8, self.slot_bytes, start)

    def commit(
        self,
        slot: int,
        step: int,
        layout: dict[str, tuple[int, int, bool]],
        digests: dict[str, str],
    ) -> None:
        """Slot ``slot`` holds the snapshot of ``step``: each file at (offset, length, is an
        array) of the payload, with its digest. Then the oldest beyond ``keep`` go."""
        header = json.dumps(
            {"step": step, "files": layout, "digests": digests, "taken": time.time()}
        ).encode()
        if 24 + len(header) > self.SLOT_HEAD:
            raise ValueError(f"a snapshot header of {len(header)} bytes does not fit a slot's")
        start = self._start(slot)
        struct.pack_into("<Q", self.memory, start + 16, len(header))
        self.memory[start + 24 : start + 24 + len(header)] = header
        self._set_state(slot, self.COMMITTED, step)
        self._count(0, add=1)

    def release(self, slot: int) -> None:
        """A slot whose snapshot was not committed (not finite, too big): empty again."""
        self._set_state(slot, self.EMPTY)

    def keep_newest(self, keep: int) -> list[int]:
        """Drops committed snapshots older than the newest ``keep``; their steps."""
        held = self.committed()
        old = sorted(held, reverse=True)[keep:]
        for step in old:
            self.drop(step)
        return old

    def drop(self, step: int) -> bool:
        slot = self.committed().get(step)
        if slot is None:
            return False
        self._set_state(slot, self.EMPTY)
        self._count(1, add=1)
        return True

    # -- reading ----------------------------------------------------------------------------

    def read(self, step: int) -> Snapshot | None:
        """The snapshot of ``step`` as it lies in the ring (arrays are views of the ring's
        memory: verify before use, copy what must outlive the next write), or None."""
        slot = self.committed().get(step)
        if slot is None:
            return None
        start = self._start(slot)
        length = struct.unpack_from("<Q", self.memory, start + 16)[0]
        try:
            header = json.loads(bytes(self.memory[start + 24 : start + 24 + length]))
        except ValueError:
            return None  # a header overwritten under the reader: not this snapshot
        if header.get("step") != step:
            return None
        payload, files = self.payload(slot), {}
        for name, (offset, size, is_array) in header["files"].items():
            data = payload[offset : offset + size]
            files[name] = data if is_array else data.tobytes()
        return Snapshot(step, files, header["digests"], header["taken"])


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
    """The run's holder as a Ray actor on this (the driver's) node, owned by the driver."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_restarts=0)(SnapshotHolder)
    # Pinned (soft=False, as the run ledger): placed elsewhere, it could die with a worker node.
    strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return actor.options(scheduling_strategy=strategy).remote(int(cap_mb * 2**20), keep, True)


__all__ = [
    "Buffer",
    "Ring",
    "RingRef",
    "Snapshot",
    "SnapshotHolder",
    "digest",
    "digest_all",
    "machine",
    "start_holder",
]
