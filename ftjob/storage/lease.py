"""One writer per run: a fenced lease in the run's storage.

A second driver for the same run (a user who thinks the first one died, a scheduler that
restarts drivers) would train into the same checkpoint directory, each pruning the other's
checkpoints. So a run has one holder at a time, decided by the storage itself:

- **Generations, taken by exclusive create.** The lease is ``{run}/lease/{generation}.json``;
  the holder is the newest generation. A driver takes the run by creating the next
  generation with ``pipe_file(mode="create")``: an atomic exclusive create on local and shared
  filesystems, a conditional write (``If-None-Match: *``) on S3 (see
  :func:`ftjob.storage.fs.exclusive_create_guarantee`). Of several drivers started at the same
  instant exactly one creates it; the others are refused. Nobody ever rewrites another
  driver's generation.
- **Age on one clock, confirmed by the beat counter.** The holder renews by rewriting its own
  generation file with a higher beat count; its age is the store's modification time of that
  file against the modification time of a probe the reader writes now -- both stamped by the
  store, so a host whose clock runs ahead cannot take over a live run. A lease that looks
  expired is watched for half its timeout before it is taken: if its beat counter moves, the
  holder is alive and the modification time lied (NFS attribute caching, a FUSE mount that
  stamps its client's clock). A holder that cannot renew for a whole timeout stops itself, so
  a counter that stood still while watched is a holder that is gone or going. A generation
  that cannot be read (torn, or from a newer ftjob) counts as held.
- **Fencing.** :meth:`RunLease.check` (for the driver) and :class:`LeaseFence` (for the
  workers, which commit and prune the checkpoints) raise :class:`LeaseLost` once a newer
  generation exists, naming its holder: every checkpoint commit and every prune is checked,
  so a driver paused past the timeout (SIGSTOP, a VM freeze) writes nothing after it wakes.
  What is left is the moment between a check and the write it guards.
- **Renewal is time-boxed** (:class:`LeaseKeeper`: a thread, retries bounded well inside the
  timeout), so a storage outage never blocks the driver's main loop or its SIGTERM handling.

A holder that was a process of this machine -- the same kernel boot *and* pid namespace, not
merely the same hostname, which containers share -- and is gone need not be waited out (a
sweep resumed right after it was killed). Owner, machine and sleep are injectable for tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.placement import machine
from ftjob.storage.errors import is_storage_error
from ftjob.storage.retry import RetryPolicy
from ftjob.storage.urls import is_object_store

logger = logging.getLogger("ftjob.storage.lease")

LEASE_DIR = "lease"
_GENERATION = re.compile(r"^(\d{9})\.json$")


class LeaseHeld(RuntimeError):
    """Another live driver holds the run."""


class LeaseLost(RuntimeError):
    """This driver held the run, and another one has taken it over since."""


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def holder_gone(record: dict[str, Any], here: str | None = None) -> bool:
    """Is the lease's holder a process of this machine (same boot and pid namespace:
    ``here``) that no longer exists? (Its heartbeat need not be waited out: a sweep resumed
    right after it was killed.) A holder elsewhere, or of unknown machine, is never known
    gone: its timeout is waited out."""
    host, _, pid = str(record.get("owner", "")).rpartition(":")
    here = machine() if here is None else here
    if host != socket.gethostname() or not here or record.get("machine") != here:
        return False
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def _file(directory: str, generation: int) -> str:
    return posixpath.join(directory, f"{generation:09d}.json")


def generations(fs: Any, directory: str) -> list[int]:
    """The lease generations in ``directory``, newest first."""
    try:
        entries = fs.ls(directory, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    found = [_GENERATION.match(posixpath.basename(str(e).rstrip("/"))) for e in entries]
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def read_generation(fs: Any, directory: str, generation: int) -> dict[str, Any] | None:
    """The record of ``generation``; ``{}`` when it exists but cannot be read as one (torn,
    or unknown): held by somebody, never free. None when it is gone."""
    try:
        record = json.loads(fs.cat_file(_file(directory, generation)))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


@dataclass(frozen=True)
class LeaseFence:
    """What a worker needs to check that its driver still holds the run (it pickles with the
    run's filesystem). Called before every commit and prune."""

    fs: Any
    directory: str
    generation: int
    token: str
    run_name: str

    def __call__(self) -> None:
        top = generations(self.fs, self.directory)
        newest = top[0] if top else None
        held = read_generation(self.fs, self.directory, newest) if newest else None
        if newest == self.generation and held is not None and held.get("token") == self.token:
            return
        if newest is None:
            why = f"its lease in {self.directory} is gone (deleted?)"
        elif newest == self.generation:
            why = (
                f"its lease generation {newest} was removed, or rewritten by another process"
                if held is None or held
                else f"its lease generation {newest} is unreadable"
            )
        else:
            why = (
                f"it is now held by another driver ({(held or {}).get('owner', 'unknown')}, "
                f"lease generation {newest})"
            )
        raise LeaseLost(
            f"run {self.run_name!r}: {why}; this driver held generation {self.generation} and "
            "stopped writing to it"
        )


class RunLease:
    """This driver's hold on one run. ``acquire`` once, ``renew`` (or a :class:`LeaseKeeper`)
    while it runs, ``release`` at the end."""

    def __init__(
        self,
        fs: Any,
        run_path: str,
        timeout: float,
        *,
        run_name: str = "",
        owner: str | None = None,
        here: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        wait_out: bool = False,
    ) -> None:
        self.fs, self.timeout, self.sleep = fs, timeout, sleep
        # A holder that looks alive (renewed within the timeout) is watched until it would
        # have expired, and half a timeout more, instead of refused at once: a scheduler that
        # reruns a dead driver's command on another machine (resume=auto) waits it out; a
        # holder that beats meanwhile refuses it all the same.
        self.wait_out = wait_out
        self.machine = machine() if here is None else here
        self.directory = posixpath.join(run_path.rstrip("/"), LEASE_DIR)
        self.run_name = run_name or posixpath.basename(run_path.rstrip("/"))
        self.owner = owner or this_process()
        self.token = secrets.token_hex(8)  # tells this driver from a restarted one with its pid
        self.generation: int | None = None
        self.beats = 0
        self.renewed = 0.0  # time.monotonic() of the last renewal

    # -- the store's clock ---------------------------------------------------------------------

    def _age(self, generation: int) -> float:
        """Seconds since ``generation`` was last written, on the store's clock: its
        modification time against that of a probe written now."""
        probe = posixpath.join(self.directory, f"clock-{self.token}-{secrets.token_hex(4)}")
        self.fs.pipe_file(probe, b"")
        try:
            now = self.fs.modified(probe)
        finally:
            try:
                self.fs.rm_file(probe)
            except FileNotFoundError:
                pass
        return (now - self.fs.modified(_file(self.directory, generation))).total_seconds()

    # -- acquire, renew, release ---------------------------------------------------------------

    def _record(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "machine": self.machine,
                "token": self.token,
                "beats": self.beats,
                "wall": time.time(),
            }
        ).encode()

    def acquire(self) -> str | None:
        """Take the run: create the next generation, or raise :class:`LeaseHeld` while another
        driver's is alive. Returns a note when an expired (or released) lease was taken over."""
        if not is_object_store(self.fs.protocol):
            self.fs.makedirs(self.directory, exist_ok=True)
        top = generations(self.fs, self.directory)
        note = None
        candidate = 1
        if top:
            newest = top[0]
            held = read_generation(self.fs, self.directory, newest)
            candidate = newest + 1
            if held is not None and not held.get("released"):
                note = self._may_take(newest, held)
        try:
            self.fs.pipe_file(_file(self.directory, candidate), self._record(), mode="create")
        except FileExistsError:
            held = read_generation(self.fs, self.directory, candidate) or {}
            raise LeaseHeld(
                f"run {self.run_name!r} was taken by another driver "
                f"({held.get('owner', 'unknown')}) at the same moment"
            ) from None
        self.generation = candidate
        self.renewed = time.monotonic()
        try:  # a backend without an atomic create shows the winner of a race on read-back
            self.check()
        except LeaseLost:
            raise LeaseHeld(
                f"run {self.run_name!r} was taken by another driver at the same moment"
            ) from None
        for old in top:
            try:
                self.fs.rm_file(_file(self.directory, old))
            except FileNotFoundError:
                pass
        return note

    def _may_take(self, generation: int, held: dict[str, Any]) -> str:
        """The note that says why a live-looking ``generation`` may be taken over, or
        :class:`LeaseHeld`: its holder is a gone process of this machine, or it is older than
        the timeout on the store's clock *and* its beat counter stood still while watched for
        half the timeout."""
        owner = str(held.get("owner", "unknown"))
        if holder_gone(held, self.machine):
            return f"took over run {self.run_name!r} from {owner}: that process is gone"
        age = self._age(generation)
        if age < self.timeout and not self.wait_out:
            raise LeaseHeld(
                f"run {self.run_name!r} is being trained by another driver ({owner}, last "
                f"renewed {max(age, 0):.0f} s ago by the store's clock): stop it first, or wait "
                f"checkpoint.lease_timeout={self.timeout:g} s after it died to take over"
            )
        watch = self.timeout / 2 + max(self.timeout - age, 0.0)
        logger.warning(
            "run %r: the lease of %s is %.0f s old by the store's clock; watching its beat "
            "counter for %.0f s before taking it over",
            self.run_name,
            owner,
            age,
            watch,
        )
        self.sleep(watch)
        now = read_generation(self.fs, self.directory, generation)
        if now is None:  # a newer generation's driver removed it: taken while watched
            raise LeaseHeld(
                f"run {self.run_name!r} was taken over by another driver while this one "
                f"watched the silent lease of {owner}"
            )
        if now.get("released"):
            return f"took over run {self.run_name!r} from {owner}: it released the run"
        if now.get("beats") != held.get("beats") and age < self.timeout:
            raise LeaseHeld(
                f"run {self.run_name!r} is being trained by another driver ({owner}): its beat "
                f"counter moved while watched {watch:.0f} s: stop it first"
            )
        if now.get("beats") != held.get("beats"):
            raise LeaseHeld(
                f"run {self.run_name!r} is being trained by another driver ({owner}): its lease "
                f"looked {age:.0f} s old by the store's modification times, but its beat counter "
                "moved while watched (a filesystem that caches or stamps times on its clients?)"
            )
        return (
            f"took over run {self.run_name!r} from {owner}, silent for {age:.0f} s "
            f"(checkpoint.lease_timeout={self.timeout:g} s) and still while watched {watch:.0f} s"
        )

    def holder(self) -> str | None:
        """Who holds the run now, said without waiting or taking it: the newest generation's
        owner while it is unreleased, not a gone process of this machine, and renewed within
        the timeout on the store's clock; None when the run is free (or its holder silent)."""
        top = generations(self.fs, self.directory)
        held = read_generation(self.fs, self.directory, top[0]) if top else None
        if held is None or held.get("released") or holder_gone(held, self.machine):
            return None
        if self._age(top[0]) >= self.timeout:
            return None
        return str(held.get("owner", "unknown"))

    def fence(self) -> LeaseFence:
        """The check the workers run before every checkpoint commit and prune."""
        if self.generation is None:
            raise RuntimeError("the run lease was not acquired")
        return LeaseFence(self.fs, self.directory, self.generation, self.token, self.run_name)

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the run is no longer this driver's."""
        self.fence()()

    def renew(self) -> None:
        """Check the fence, then rewrite this driver's own generation (its modification time
        is the heartbeat others read). Raises :class:`LeaseLost`, and storage errors."""
        self.check()
        self.beats += 1
        assert self.generation is not None
        self.fs.pipe_file(_file(self.directory, self.generation), self._record())
        self.renewed = time.monotonic()

    def release(self) -> None:
        """Give the run up, if it is still ours: the generation says so, and the next driver
        takes over at once (a generation is never deleted by a driver that might be deposed)."""
        if self.generation is None:
            return
        try:
            self.check()
            record = {**json.loads(self._record()), "released": True}
            self.fs.pipe_file(_file(self.directory, self.generation), json.dumps(record).encode())
        except LeaseLost:
            return
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            logger.warning("releasing the run lease in %s failed: %s", self.directory, exc)


def bounded_filesystem(fs: Any, deadline: float) -> Any:
    """``fs`` (a :class:`~ftjob.storage.fs.RetryingFileSystem`) with its retries bounded to
    ``deadline`` seconds per call: renewals must end well inside the lease timeout."""
    from ftjob.storage.fs import RetryingFileSystem

    if not isinstance(fs, RetryingFileSystem):
        return fs
    c = fs.policy.config
    config = dataclasses.replace(
        c,
        deadline=min(deadline, c.deadline or deadline),
        max_backoff=max(c.initial_backoff, min(c.max_backoff, deadline / 4)),
    )
    return RetryingFileSystem(fs.fs, RetryPolicy(config))


class LeaseKeeper:
    """Renews the lease every quarter of its timeout on a thread of its own, each renewal's
    retries bounded to that quarter. ``lost`` is set (a one-line reason) once the run is
    another driver's; the driver's loop reads it and stops the run."""

    def __init__(
        self,
        lease: RunLease,
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lease, self.clock = lease, clock
        self.interval = interval if interval is not None else lease.timeout / 4
        lease.fs = bounded_filesystem(lease.fs, self.interval)
        self.lost: str | None = None
        self.renewed = clock()  # of the last renewal that went through (the keeper's clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftjob-lease", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def renew_once(self) -> None:
        try:
            self.lease.renew()
            self.renewed = self.clock()
        except LeaseLost as exc:
            self.lost = str(exc)
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            silent = self.clock() - self.renewed
            logger.warning(
                "renewing the run lease failed (%.0f s of the %g s lease without a renewal): %s",
                silent,
                self.lease.timeout,
                exc,
            )
            if silent >= self.lease.timeout:  # another driver may take the run now
                self.lost = (
                    f"run {self.lease.run_name!r}: the lease could not be renewed for "
                    f"{silent:.0f} s (checkpoint.lease_timeout={self.lease.timeout:g} s; last "
                    f"error: {type(exc).__name__}: {exc}): another driver may take the run "
                    "over, so this one stopped writing to it"
                )

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.lost is None:
            self.renew_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 1)
