"""Storage faults on purpose (``chaos.storage``): a seeded share of failed requests, and slow
checkpoint uploads -- a layer under the retrying filesystem, so the retry policy meets them
where real faults arrive.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from fsspec import AbstractFileSystem

from ftjob.storage.wrapper import OPERATIONS, DelegatingFileSystem

INJECTED_ERRORS: dict[str, Callable[[str], Exception]] = {
    "throttle": lambda p: OSError(
        errno.EBUSY, f"SlowDown: Please reduce your request rate (injected, {p})"
    ),
    "reset": lambda p: ConnectionResetError(
        errno.ECONNRESET, f"Connection reset by peer (injected, {p})"
    ),
    "timeout": lambda p: TimeoutError(errno.ETIMEDOUT, f"Read timed out (injected, {p})"),
    "permanent": lambda p: PermissionError(errno.EACCES, f"AccessDenied (injected, {p})"),
}


def is_checkpoint_upload(op: str, path: str) -> bool:
    """An upload of checkpoint data (``.../checkpoints/step_N/...``), not Ray Train's own
    bookkeeping (storage marker, checkpoint manager snapshot)."""
    return OPERATIONS.get(op) == "upload" and "/checkpoints/step_" in f"/{path}"


class FaultInjectingFileSystem(DelegatingFileSystem):
    """Fails a seeded fraction of requests before they reach ``fs``, and slows checkpoint
    uploads by ``upload_delay`` seconds each (chaos.storage: a slow or congested store).

    Transient kinds hit any request, Ray Train's included: the retry layer must absorb them
    wherever they happen. A ``permanent`` fault hits only checkpoint uploads (a write that is
    denied), which ftjob can survive (``checkpoint.max_consecutive_upload_failures``); drawn for
    any other request it is not injected, since a permanent error there only ends the job.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        failure_rate: float,
        errors: list[str],
        seed: int = 0,
        upload_delay: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        **kwargs: Any,
    ) -> None:
        super().__init__(fs)
        self.failure_rate, self.errors, self.seed = failure_rate, list(errors), seed
        self.upload_delay, self.sleep = upload_delay, sleep
        self._lock = threading.Lock()
        self.set_stream("main")
        self.injected = 0

    def set_stream(self, name: str) -> None:
        """Draw faults from the stream ``(seed, name)``: each process (a worker of an attempt,
        the controller) gets its own reproducible sequence instead of all repeating one."""
        with self._lock:
            self.rng = random.Random(f"ftjob-storage-chaos:{self.seed}:{name}")

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        with self._lock:
            fail = self.rng.random() < self.failure_rate
            kind = self.rng.choice(self.errors) if fail else None
            if kind == "permanent" and not is_checkpoint_upload(op, path):
                kind = None
            self.injected += kind is not None
        if kind is not None:
            raise INJECTED_ERRORS[kind](f"{op} {path}")
        if self.upload_delay and is_checkpoint_upload(op, path):
            self.sleep(self.upload_delay)
        return fn()


def set_fault_stream(fs: AbstractFileSystem, name: str) -> None:
    """Give the fault injector under ``fs`` (if any) its own stream ``name``."""
    inner: Any = fs
    while isinstance(inner, DelegatingFileSystem):
        if isinstance(inner, FaultInjectingFileSystem):
            inner.set_stream(name)
            return
        inner = inner.fs
