"""A snapshot ring's slots (:class:`~ftjob.memory.ring.Ring`): their headers, the
claims writers hold on them, commits and retention -- each fenced by the run's lease generation
and by the claim itself, so that no writer's bytes ever lie under another writer's digests.

**A claim is its writer's until it commits or releases it, or dies.** A writer holds a lock on
its slot's header (an open file description's lock on the ring's memory file: the kernel lets
it go when the writer's process dies, however it dies, and never while it lives -- frozen,
stopped, or paused with its VM), and every write after the claim checks that the claim is
still its own: no writer ever takes a slot another live process is writing (whose bytes would
land under its digests), and a writer commits and releases only its own claim. Nor does
anything else change a slot a writer holds: the holder's drops and discards and the writers'
retention take the slot's lock first. A claim takes an empty slot, else one whose writer died
mid-write, else frees the oldest committed snapshot of the writer's generation or an older
one -- never the newest, never a newer generation's; with none of these it is refused
(:class:`Slots.Busy`: that snapshot is skipped, the next one tries again).

The ring's head holds the run's fence (:mod:`ftjob.memory.fence`): the lease
generation the holder was told holds the run. A writer of an older generation is refused
(:class:`Slots.Fenced`) before it claims a slot, once its claim is made and again before it
commits; what a slow writer commits between the check and the holder's fence carries its
generation, and the holder never offers it; and a writer's retention never empties a slot of
a newer generation than its own, nor anything once the fence refuses it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SlotEntry:
    """A committed slot as its fixed header has it: the step, the lease generation of the
    driver whose worker wrote it (0: unknown -- no lease, or a ring without them) and the
    random ``nonce`` its writer's claim drew (which claim and commit of the slot this is: a
    slot written again draws another)."""

    slot: int
    step: int
    generation: int
    nonce: int


class Slots:
    """The slots of a ring mapped at ``memory``, and this mapping's claims on them, held
    through ``fd`` (this mapping's own open file description of the memory file).

    Slot ``i``: a header -- its state, its step, the JSON's length, the lease generation and
    the nonce of its writer's claim, then JSON naming each file's offset, length and digest --
    and ``slot_bytes`` of payload. The writer claims a slot before it touches it and commits
    it after every byte and the header are in, so a writer that dies half-way leaves a slot no
    reader takes."""

    MAGIC = b"ftjob-snapshots3"  # 3: a slot's claim locked by its writer, fenced at every step
    TOKEN = 16
    HEAD = 64  # magic, token, taken, dropped, fence
    SLOT_HEAD = 64 * 1024  # state, step, JSON length, generation, nonce, JSON
    JSON_AT = 40
    EMPTY, WRITING, COMMITTED = 0, 1, 2

    class Fenced(RuntimeError):
        """The ring's holder is fenced by a newer lease generation than the writer's."""

    class Busy(RuntimeError):
        """No slot this writer may take now (live writers hold the others, and the newest
        snapshot is never given up), or its claim is no longer its own: the snapshot is
        skipped; the next one tries again."""

    def __init__(self, memory: mmap.mmap, slots: int, slot_bytes: int, fd: int) -> None:
        self.memory, self.slots, self.slot_bytes, self.fd = memory, slots, slot_bytes, fd
        self.claims: dict[int, tuple[int, int]] = {}  # slot -> (nonce, generation): this one's

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
            raise Slots.Fenced(
                f"the snapshot holder is fenced by lease generation {fence} and this worker's "
                f"driver held generation {generation}: another driver took the run"
            )

    def _start(self, slot: int) -> int:
        return self.HEAD + slot * (self.SLOT_HEAD + self.slot_bytes)

    def _header(self, slot: int) -> tuple[int, int, int, int, int]:
        """State, step, JSON length, generation and nonce of slot ``slot``."""
        return struct.unpack_from("<QQQQQ", self.memory, self._start(slot))

    def _set_state(self, slot: int, state: int, step: int = 0) -> None:
        struct.pack_into("<QQ", self.memory, self._start(slot), state, step)

    def committed(self) -> dict[int, int]:
        """Step -> slot of every committed snapshot."""
        return {entry.step: entry.slot for entry in self.entries()}

    def entries(self) -> list[SlotEntry]:
        """Every committed slot, with its writer's generation and its claim's nonce."""
        found = []
        for slot in range(self.slots):
            state, step, _, generation, nonce = self._header(slot)
            if state == self.COMMITTED:
                found.append(SlotEntry(slot, step, generation, nonce))
        return found

    # -- the slots' locks -------------------------------------------------------------------

    def _lock(self, slot: int) -> bool:
        """Slot ``slot``'s lock taken through this mapping, without waiting; False where
        another process (or mapping) holds it, or this one's claim does (a claim is only
        ever let go by its commit or release)."""
        if slot in self.claims:
            return False
        try:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, self._start(slot)))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _unlock(self, slot: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, self._start(slot)))

    # -- writing ----------------------------------------------------------------------------

    def claim(self, generation: int | None = None) -> tuple[int, np.ndarray]:
        """A slot to write the next snapshot into, claimed by this writer (locked, marked as
        being written, its generation and a new nonce in its header), and its payload: an
        empty one, else one whose writer died mid-write, else the oldest committed snapshot
        :meth:`_takeable` allows. Raises :class:`Fenced` for a writer of a generation older
        than the fence, :class:`Busy` where no slot may be taken."""
        self.check_fence(generation)
        for slot in self._takeable(generation):
            if not self._lock(slot):
                continue  # a live writer's claim, however long it has been stopped
            if slot not in self._takeable(generation):  # changed before the lock was taken
                self._unlock(slot)
                continue
            if self._header(slot)[0] == self.COMMITTED:
                self._count(1, add=1)  # a snapshot dropped to make room
            nonce = secrets.randbits(63) + 1
            struct.pack_into(
                "<QQQQQ", self.memory, self._start(slot), self.WRITING, 0, 0, generation or 0, nonce
            )
            self.claims[slot] = (nonce, generation or 0)
            try:
                self.check_fence(generation)  # a fence set while this writer chose its slot
            except Slots.Fenced:
                self.release(slot)
                raise
            return slot, self.payload(slot)
        raise Slots.Busy(
            f"no slot of the {self.slots} of the holder's shared memory may be taken: "
            "live writers hold the others and the newest snapshot is kept"
        )

    def _takeable(self, generation: int | None) -> list[int]:
        """The slots a writer of ``generation`` may claim, in the order it tries them: the
        empty ones, those being written (taken only where their writer's lock is gone: it
        died), then the committed snapshots of its generation or an older one (None: any)
        oldest first, but for the newest of them -- never a newer generation's."""
        headers = [self._header(slot) for slot in range(self.slots)]
        empty = [s for s, h in enumerate(headers) if h[0] == self.EMPTY]
        writing = [s for s, h in enumerate(headers) if h[0] == self.WRITING]
        older = sorted(
            (h[1], s)
            for s, h in enumerate(headers)
            if h[0] == self.COMMITTED and (generation is None or h[3] <= generation)
        )
        return [s for s in empty + writing + [s for _, s in older[:-1]] if s not in self.claims]

    def payload(self, slot: int) -> np.ndarray:
        start = self._start(slot) + self.SLOT_HEAD
        return np.frombuffer(self.memory, np.uint8, self.slot_bytes, start)

    def _own(self, slot: int) -> int:
        """The nonce of this writer's claim of ``slot``; raises :class:`Busy` where the slot
        no longer holds it."""
        nonce, _ = self.claims.get(slot, (None, 0))
        state, _, _, _, found = self._header(slot)
        if nonce is None or state != self.WRITING or found != nonce:
            raise Slots.Busy(f"slot {slot} of the holder's shared memory is not this writer's")
        return nonce

    def commit(
        self,
        slot: int,
        step: int,
        layout: dict[str, tuple[int, int, bool]],
        digests: dict[str, str],
        generation: int | None = None,
    ) -> None:
        """Slot ``slot``, this writer's claim, holds the snapshot of ``step``: each file at
        (offset, length, is an array) of the payload, with its digest. ``generation``: the
        claim's. Raises :class:`Fenced` (the claim released) when the fence is newer by now,
        :class:`Busy` when the slot is not this writer's claim."""
        try:
            self._own(slot)
        except Slots.Busy:
            self.claims.pop(slot, None)
            self._unlock(slot)
            raise
        if (generation or 0) != self.claims[slot][1]:
            raise ValueError(f"slot {slot} was claimed by generation {self.claims[slot][1]}")
        header = json.dumps(
            {"step": step, "files": layout, "digests": digests, "taken": time.time()}
        ).encode()
        if self.JSON_AT + len(header) > self.SLOT_HEAD:
            raise ValueError(f"a snapshot header of {len(header)} bytes does not fit a slot's")
        start = self._start(slot)
        struct.pack_into("<Q", self.memory, start + 16, len(header))
        self.memory[start + self.JSON_AT : start + self.JSON_AT + len(header)] = header
        try:
            self.check_fence(generation)
        except Slots.Fenced:
            self.release(slot)
            raise
        self._set_state(slot, self.COMMITTED, step)
        self._count(0, add=1)
        del self.claims[slot]
        self._unlock(slot)

    def release(self, slot: int) -> bool:
        """This writer's claim of ``slot`` given up unwritten (not finite, too big, fenced):
        the slot empty again. A slot that is not its claim is left as it is (False)."""
        if slot not in self.claims:
            return False
        nonce, _ = self.claims.pop(slot)
        state, _, _, _, found = self._header(slot)
        mine = state == self.WRITING and found == nonce
        if mine:
            self._set_state(slot, self.EMPTY)  # before the lock goes: no other claim yet
        self._unlock(slot)
        return mine

    def discard(self, slot: int, nonce: int) -> bool:
        """Slot ``slot`` emptied if it still holds the commit ``nonce`` and no writer is
        claiming it (the holder's: one no restore may read; a writer's retention)."""
        if not self._lock(slot):
            return False
        try:
            state, _, _, _, found = self._header(slot)
            if state != self.COMMITTED or found != nonce:
                return False
            self._set_state(slot, self.EMPTY)
            self._count(1, add=1)
            return True
        finally:
            self._unlock(slot)

    def keep_newest(self, keep: int, generation: int | None = None) -> list[int]:
        """Drops committed snapshots older than the newest ``keep``; their steps. With the
        writer's ``generation``, first every slot of an older one (a deposed driver's worker's
        commit that slipped past the fence: its later step must not count as the newest), and
        then only its own generation's: a writer the fence refuses by now (it was stopped
        after its commit) empties nothing."""
        fence = self.fence()
        if generation is not None and fence and generation < fence:
            return []
        entries = self.entries()
        if generation is not None:
            for e in entries:
                if e.generation < generation:
                    self.discard(e.slot, e.nonce)
            entries = [e for e in entries if e.generation == generation]
        old = sorted({e.step for e in entries}, reverse=True)[keep:]
        for e in entries:
            if e.step in old:
                self.discard(e.slot, e.nonce)
        return old

    def drop(self, step: int) -> bool:
        """Every committed slot of ``step`` emptied (a writer of another generation may have
        committed the same step in a slot of its own), but for one a writer is claiming."""
        return any([self.discard(e.slot, e.nonce) for e in self.entries() if e.step == step])


def _flock(kind: int, start: int) -> bytes:
    """A ``struct flock`` for an open file description's lock on one byte at ``start``."""
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)


__all__ = ["SlotEntry", "Slots"]
