"""The memory tier's shared-memory ring: snapshot slots a rank on the holder's machine writes
into, with no call per snapshot; and :class:`Arena`, which lays a snapshot's buffers out in a
slot's payload so its tensors are copied straight into the memory the holder reads.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ftjob.storage.memory.format import ALIGN, Buffer, Snapshot


def machine() -> str:
    """Which kernel and pid namespace this process runs in: two processes that agree can map
    each other's memory files through ``/proc/<pid>/fd``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


@dataclass(frozen=True)
class SlotEntry:
    """A committed slot as its fixed header has it: the step, the lease generation of the
    driver whose worker wrote it (0: unknown -- no lease, or a ring without them) and the
    random ``nonce`` its commit drew (which commit of the slot this is: a slot written again
    draws another)."""

    slot: int
    step: int
    generation: int
    nonce: int


_PAGE_LOCKED: list[mmap.mmap] = []  # mappings page-locked for a GPU, kept mapped until unlocked


class Ring:
    """Snapshot slots in one block of shared memory: the channel from a rank to the holder on
    its machine that costs no call per snapshot (the Ray path costs an actor call carrying the
    snapshot and the holder's copy of it, each time).

    The holder creates it (:meth:`create`): an anonymous memory file (``memfd``) that exists
    only while a process maps it or holds it open -- nothing to clean up when the holder dies
    however it dies. A process on the same machine opens it through ``/proc/<holder>/fd/<n>``
    (:meth:`attach`) and checks the random token at its start: another machine, or another
    process behind the same pid (a container's), finds no token and uses the Ray path.

    Slot ``i``: a header -- its state, its step, the JSON's length, the writer's lease
    generation and the commit's nonce, then JSON naming each file's offset, length and digest
    -- and ``slot_bytes`` of payload. The writer marks a slot being written before
    it touches it and committed after every byte and the header are in, so a writer that dies
    half-way leaves a slot no reader takes; and a reader trusts a slot only when every file
    matches its digest. One writer at a time (the rank taking snapshots); a reader reads while
    no snapshot is being written (a restore, before training resumes).

    The ring's head holds the run's fence (:mod:`ftjob.storage.memory.fence`): the lease
    generation the holder was told holds the run. A writer of an older generation is refused
    (:class:`Fenced`) before it claims a slot and again before it commits one; what a slow
    writer commits between the check and the holder's fence carries its generation, and the
    holder never offers it."""

    MAGIC = b"ftjob-snapshots2"  # 2: slot headers carry the writer's generation and a nonce
    TOKEN = 16
    HEAD = 64  # magic, token, taken, dropped, fence
    SLOT_HEAD = 64 * 1024  # state, step, JSON length, generation, nonce, JSON
    JSON_AT = 40
    EMPTY, WRITING, COMMITTED = 0, 1, 2

    class Fenced(RuntimeError):
        """The ring's holder is fenced by a newer lease generation than the writer's."""

    def __init__(self, memory: mmap.mmap, address: dict[str, Any], fd: int | None = None) -> None:
        self.memory, self.address, self.fd = memory, address, fd  # fd: the holder's, kept open
        self.locked: int | None = None  # where the mapping is page-locked (:meth:`page_lock`)
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

    def page_lock(self) -> bool:
        """In a process that trains on a GPU (CUDA initialised), this mapping page-locked
        (``cudaHostRegister``) for as long as the process lives, so the copy engine writes
        snapshots straight into it: a copy into pageable memory goes through the driver's
        staging buffers (on an H200, a ResNet-50 state's 195 MB took 19.4 ms into pageable
        memory and 6.9 ms into this mapping locked: benchmarks/gpu_snapshot_copy.py). False
        elsewhere, or where the driver refuses (the copies then go as before): its refusal is
        read back at once by a kernel's launch check, which clears it, so that no later launch
        raises it."""
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return False
        cudart = torch.cuda.cudart()
        view = np.frombuffer(self.memory, np.uint8)
        if cudart.cudaHostRegister(view.ctypes.data, view.nbytes, 0) == cudart.cudaError.success:
            # Never unmapped while registered, whatever becomes of this object: pages unmapped
            # under a registration would stay the device's target at that address.
            self.locked = view.ctypes.data
            _PAGE_LOCKED.append(self.memory)
            return True
        try:
            torch.zeros(1, device="cuda").add_(1)  # reads the refusal (and clears it)
        except RuntimeError:
            pass
        return False

    def close(self) -> None:
        """The holder lets its ring go (its memory goes once no process maps it); a process
        that page-locked it unlocks it first."""
        if self.locked is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.locked)
            self.locked = None
            _PAGE_LOCKED.remove(self.memory)
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

    def fence(self) -> int:
        """The lease generation the holder was told holds the run (0: none yet)."""
        return self._count(2)

    def set_fence(self, generation: int) -> None:
        """The holder's alone: writers of an older generation are refused from now on."""
        struct.pack_into("<Q", self.memory, len(self.MAGIC) + self.TOKEN + 16, generation)

    def check_fence(self, generation: int | None) -> None:
        """Raises :class:`Fenced` when the ring is fenced by a newer generation than
        ``generation`` (None: a writer without a lease, refused by any fence)."""
        fence = self.fence()
        if fence and (generation is None or generation < fence):
            raise Ring.Fenced(
                f"the snapshot holder is fenced by lease generation {fence} and this worker's "
                f"driver held generation {generation}: another driver took the run"
            )

    def _start(self, slot: int) -> int:
        return self.HEAD + slot * (self.SLOT_HEAD + self.slot_bytes)

    def _state(self, slot: int) -> tuple[int, int]:
        return struct.unpack_from("<QQ", self.memory, self._start(slot))  # type: ignore[return-value]

    def _set_state(self, slot: int, state: int, step: int = 0) -> None:
        struct.pack_into("<QQ", self.memory, self._start(slot), state, step)

    def committed(self) -> dict[int, int]:
        """Step -> slot of every committed snapshot."""
        return {entry.step: entry.slot for entry in self.entries()}

    def entries(self) -> list[SlotEntry]:
        """Every committed slot, with its writer's generation and its commit's nonce."""
        found = []
        for slot in range(self.slots):
            state, step, _, generation, nonce = struct.unpack_from(
                "<QQQQQ", self.memory, self._start(slot)
            )
            if state == self.COMMITTED:
                found.append(SlotEntry(slot, step, generation, nonce))
        return found

    # -- writing ----------------------------------------------------------------------------

    def claim(self, generation: int | None = None) -> tuple[int, np.ndarray]:
        """A slot to write the next snapshot into, marked as being written, and its payload: an
        empty one (a deposed worker may be writing its own), else one a dead writer left being
        written. Raises :class:`Fenced` for a writer of a generation older than the fence."""
        self.check_fence(generation)
        states = [self._state(s)[0] for s in range(self.slots)]
        free = [s for s, state in enumerate(states) if state == self.EMPTY]
        slot = free[0] if free else states.index(self.WRITING)
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
        generation: int | None = None,
    ) -> None:
        """Slot ``slot`` holds the snapshot of ``step``, written by a worker of lease
        ``generation``: each file at (offset, length, is an array) of the payload, with its
        digest. Raises :class:`Fenced` (the slot emptied) when the fence is newer by now."""
        header = json.dumps(
            {"step": step, "files": layout, "digests": digests, "taken": time.time()}
        ).encode()
        if self.JSON_AT + len(header) > self.SLOT_HEAD:
            raise ValueError(f"a snapshot header of {len(header)} bytes does not fit a slot's")
        start, nonce = self._start(slot), secrets.randbits(63) + 1
        struct.pack_into("<QQQ", self.memory, start + 16, len(header), generation or 0, nonce)
        self.memory[start + self.JSON_AT : start + self.JSON_AT + len(header)] = header
        try:
            self.check_fence(generation)
        except Ring.Fenced:
            self.release(slot)
            raise
        self._set_state(slot, self.COMMITTED, step)
        self._count(0, add=1)

    def release(self, slot: int) -> None:
        """A slot whose snapshot was not committed (not finite, too big): empty again."""
        self._set_state(slot, self.EMPTY)

    def discard(self, slot: int, nonce: int) -> bool:
        """Slot ``slot`` emptied if it still holds the commit ``nonce`` (the holder's: one no
        restore may read)."""
        state, _, _, _, found = struct.unpack_from("<QQQQQ", self.memory, self._start(slot))
        if state != self.COMMITTED or found != nonce:
            return False
        self._set_state(slot, self.EMPTY)
        self._count(1, add=1)
        return True

    def keep_newest(self, keep: int, generation: int | None = None) -> list[int]:
        """Drops committed snapshots older than the newest ``keep``; their steps. With the
        writer's ``generation``, first every slot of another one (a deposed driver's worker's
        commit that slipped past the fence: its later step must not count as the newest)."""
        if generation is not None:
            for e in self.entries():
                if e.generation != generation:
                    self.discard(e.slot, e.nonce)
        held = self.committed()
        old = sorted(held, reverse=True)[keep:]
        for step in old:
            self.drop(step)
        return old

    def drop(self, step: int) -> bool:
        """Every committed slot of ``step`` emptied (a writer of another generation may have
        committed the same step in a slot of its own)."""
        slots = [entry.slot for entry in self.entries() if entry.step == step]
        for slot in slots:
            self._set_state(slot, self.EMPTY)
            self._count(1, add=1)
        return bool(slots)

    # -- reading ----------------------------------------------------------------------------

    def read(self, step: int, nonce: int | None = None) -> Snapshot | None:
        """The snapshot of ``step`` as it lies in the ring (arrays are views of the ring's
        memory: verify before use, copy what must outlive the next write), or None; with
        ``nonce``, only that commit of it (the one its holder offered)."""
        slots = [e.slot for e in self.entries() if e.step == step and nonce in (None, e.nonce)]
        if not slots:
            return None
        start = self._start(slots[-1])
        length = struct.unpack_from("<Q", self.memory, start + 16)[0]
        try:
            at = start + self.JSON_AT
            header = json.loads(bytes(self.memory[at : at + length]))
        except ValueError:
            return None  # a header overwritten under the reader: not this snapshot
        if header.get("step") != step:
            return None
        payload, files = self.payload(slots[-1]), {}
        for name, (offset, size, is_array) in header["files"].items():
            data = payload[offset : offset + size]
            files[name] = data if is_array else data.tobytes()
        return Snapshot(step, files, header["digests"], header["taken"])


class Arena:
    """Buffers laid out one after another in a ring slot's payload (a uint8 array): a
    snapshot's tensors are copied straight into the memory the holder reads."""

    class Full(Exception):
        """The snapshot does not fit the slot."""

    def __init__(self, payload: np.ndarray) -> None:
        self.payload, self.end = payload, 0

    def take(self, nbytes: int) -> np.ndarray:
        start = -(-self.end // ALIGN) * ALIGN
        if start + nbytes > len(self.payload):
            raise Arena.Full(f"{start + nbytes} bytes do not fit a slot of {len(self.payload)}")
        self.end = start + nbytes
        return self.payload[start : self.end]

    def tensor(self, nbytes: int) -> Any:
        import torch

        return torch.from_numpy(self.take(nbytes))

    def place(self, files: dict[str, Buffer]) -> dict[str, tuple[int, int, bool]]:
        """Where each file lies in the payload -- (offset, length, is an array) -- copying in
        those that are not there yet (the skeletons and records :func:`pack` made)."""
        base, layout = self.payload.ctypes.data, {}
        for name, data in files.items():
            if isinstance(data, np.ndarray):
                offset = data.ctypes.data - base
                if not (0 <= offset and offset + data.nbytes <= len(self.payload)):
                    offset = self._copy_in(data)
                layout[name] = (offset, data.nbytes, True)
            else:
                layout[name] = (self._copy_in(np.frombuffer(data, np.uint8)), len(data), False)
        return layout

    def _copy_in(self, data: np.ndarray) -> int:
        view = self.take(data.nbytes)
        view[:] = data
        return view.ctypes.data - self.payload.ctypes.data


__all__ = ["Arena", "Ring", "SlotEntry", "machine"]
