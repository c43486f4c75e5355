"""The memory tier's shared-memory ring: snapshot slots a rank on the holder's machine writes
into, with no call per snapshot; and :class:`Arena`, which lays a snapshot's buffers out in a
slot's payload so its tensors are copied straight into the memory the holder reads.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import secrets
import stat
import struct
import weakref
from typing import Any

import numpy as np

from ftjob.memory.format import ALIGN, Buffer, Snapshot
from ftjob.memory.slots import SlotEntry, Slots
from ftjob.placement import machine  # where a ring may be mapped: its holder's machine

_PAGE_LOCKED: list[mmap.mmap] = []  # mappings page-locked for a GPU, kept mapped until unlocked


class Ring(Slots):
    """Snapshot slots in one block of shared memory: the channel from a rank to the holder on
    its machine that costs no call per snapshot (the Ray path costs an actor call carrying the
    snapshot and the holder's copy of it, each time).

    The holder creates it (:meth:`create`): an anonymous memory file (``memfd``) that exists
    only while a process maps it or holds it open -- nothing to clean up when the holder dies
    however it dies. A process on the same machine opens it through ``/proc/<holder>/fd/<n>``
    (:meth:`attach`) and checks the random token at its start: another machine, or another
    process behind the same pid (a container's), finds no token and uses the Ray path.

    Its slots, their claims, commits and retention, each fenced by the run's lease generation
    and by the writer's claim: :class:`~ftjob.memory.slots.Slots`. A reader trusts a
    slot only when every file matches its digest, and reads while no snapshot is being
    written into the slot it reads (a restore, before training resumes)."""

    def __init__(self, memory: mmap.mmap, address: dict[str, Any], fd: int) -> None:
        # fd: this mapping's own open file description of the memory file, kept open: its
        # claims' locks are held through it (the holder's keeps the memory alive besides).
        super().__init__(memory, address["slots"], address["slot_bytes"], fd)
        self.address = address
        self._close_fd = weakref.finalize(self, os.close, fd)
        self.locked: int | None = None  # where the mapping is page-locked (:meth:`page_lock`)

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
                raise OSError(errno.EINVAL, "not a ring of this size")
            memory = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            return None
        if memory[: len(cls.MAGIC) + cls.TOKEN] != cls.MAGIC + bytes.fromhex(address["token"]):
            memory.close()
            os.close(fd)
            return None
        return cls(memory, address, fd)  # fd kept: this writer's locks are held through it

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
        self._close_fd()  # its locks go with it (once the mapping goes too)
        try:
            self.memory.close()
        except BufferError:  # arrays still view it: the mapping goes with the last of them
            pass

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
