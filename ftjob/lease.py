"""One writer per run: a lease in the run's storage that the live driver keeps renewing.

A second driver for the same run (a user who thinks the first one died, a scheduler that
restarts drivers) would train into the same checkpoint directory until one of them trips over
the other's files. The driver holds ``{run}/lease.json`` (owner host and pid, heartbeat time)
and renews it while it runs; another driver refuses to start while the heartbeat is younger
than ``checkpoint.lease_timeout`` and takes over once it is older (the holder died without
releasing it), or at once when the holder was a process of this host that is gone. Clock and owner are injectable for tests.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from ftjob.retry import is_storage_error
from ftjob.urls import is_object_store

logger = logging.getLogger("ftjob.lease")

LEASE_FILE = "lease.json"


class LeaseHeld(RuntimeError):
    """Another live driver holds the run."""


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def holder_gone(owner: str) -> bool:
    """Is the lease's owner a process of this host that no longer exists? (Its heartbeat need
    not be waited out: a sweep resumed right after it was killed.)"""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class RunLease:
    def __init__(
        self,
        fs: Any,
        run_path: str,
        timeout: float,
        *,
        owner: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fs, self.timeout, self.clock = fs, timeout, clock
        self.path = posixpath.join(run_path.rstrip("/"), LEASE_FILE)
        self.owner = owner or this_process()
        self.token = secrets.token_hex(8)  # tells this driver from a restarted one with its pid
        self.renewed = 0.0

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn write: nobody holds it
            return None

    def _write(self) -> None:
        now = self.clock()
        record = {"owner": self.owner, "token": self.token, "heartbeat": now}
        self.fs.pipe_file(self.path, json.dumps(record).encode())
        self.renewed = now

    def acquire(self, run_name: str) -> str | None:
        """Take the lease; raises :class:`LeaseHeld` while another driver's heartbeat is
        fresh. Returns a note when an expired lease was taken over."""
        held = self._read()
        note = None
        if held is not None and held.get("token") != self.token:
            age = self.clock() - float(held.get("heartbeat", 0.0))
            if age < self.timeout and not holder_gone(str(held.get("owner", ""))):
                raise LeaseHeld(
                    f"run {run_name!r} is being trained by another driver ({held.get('owner')}, "
                    f"last heartbeat {age:.0f} s ago): stop it first, or wait "
                    f"checkpoint.lease_timeout={self.timeout:g} s after it died to take over"
                )
            note = (
                f"took over run {run_name!r} from {held.get('owner')}, silent for {age:.0f} s "
                f"(checkpoint.lease_timeout={self.timeout:g} s)"
                if age >= self.timeout
                else f"took over run {run_name!r} from {held.get('owner')}: that process is gone"
            )
        if not is_object_store(self.fs.protocol):
            self.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
        self._write()
        return note

    def renew(self) -> None:
        """Renew the heartbeat (at most every quarter of the timeout); a storage error is
        logged, not fatal: the lease only expires after the whole timeout."""
        if self.clock() - self.renewed < self.timeout / 4:
            return
        try:
            self._write()
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            logger.warning("renewing the run lease %s failed: %s", self.path, exc)

    def release(self) -> None:
        """Give the lease up, if it is still ours."""
        try:
            held = self._read()
            if held is not None and held.get("token") == self.token:
                self.fs.rm_file(self.path)
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            logger.warning("releasing the run lease %s failed: %s", self.path, exc)
