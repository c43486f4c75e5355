"""Retrying storage: one retry policy (tenacity) over any fsspec filesystem.

Layers, outermost first::

    RetryingFileSystem(policy)        what Ray Train and ftjob's checkpoint store call
      FaultInjectingFileSystem(rate)  only when chaos.storage.failure_rate > 0
        fsspec filesystem             local, memory, s3 (s3fs), gcs (gcsfs), ...

The retrying layer is handed to Ray Train as a ``pyarrow.fs.PyFileSystem``, so every write,
read and listing of the run's storage goes through the same policy, and it pickles to workers
with that policy. The retry loops below it are switched off by default so that the policy users
configure is the one that acts: s3fs's ``retries`` and botocore's ``total_max_attempts`` are 1
(``checkpoint.storage_options`` can set ``retries`` and ``config_kwargs.retries`` again).
aiohttp still re-sends an idempotent request once when a reused keep-alive connection turns
out closed (RFC 9112); that is connection upkeep, not a retry policy.
"""

from __future__ import annotations

import errno
import io
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from ftjob.config import RetryConfig, StorageChaosConfig
from ftjob.retry import OpStats, RetryPolicy, StorageStats, _one_line
from ftjob.urls import bucket_of, is_object_store

logger = logging.getLogger("ftjob.storage")

# -- filesystem wrappers ----------------------------------------------------------------------

# Operation name -> kind (for stats). Anything not listed is inherited from AbstractFileSystem
# and ends up in one of these.
OPERATIONS: dict[str, str] = {
    "pipe_file": "upload",
    "put_file": "upload",
    "cat_file": "download",
    "get_file": "download",
    "ls": "list",
    "find": "list",
    "info": "list",
    "mkdir": "other",
    "makedirs": "other",
    "rmdir": "delete",
    "rm_file": "delete",
    "rm": "delete",
    "mv": "other",
    "cp_file": "other",
    "copy": "other",
}


class _DelegatingFileSystem(AbstractFileSystem):
    """An fsspec filesystem that forwards every operation in OPERATIONS to ``self.fs``
    through :meth:`_call`. Subclasses decide what happens around the call."""

    cachable = False

    def __init__(self, fs: AbstractFileSystem, **kwargs: Any) -> None:
        super().__init__()
        self.fs = fs
        self.protocol = fs.protocol

    def unstrip_protocol(self, name: str) -> str:
        return self.fs.unstrip_protocol(name)

    def _strip_protocol(self, path: Any) -> Any:  # type: ignore[override]
        return self.fs._strip_protocol(path)

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            data = self._call("cat_file", path, lambda: self.fs.cat_file(path))
            return io.BytesIO(data)
        if "a" in mode:
            raise NotImplementedError(f"append mode is not supported on {type(self).__name__}")
        return _UploadOnClose(
            lambda data: self._call("pipe_file", path, lambda: self.fs.pipe_file(path, data))
        )


def _forward(name: str) -> Callable[..., Any]:
    def method(self: _DelegatingFileSystem, path: Any, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self.fs, name)
        # put_file(local, remote): the storage path is the second argument.
        target = args[0] if name == "put_file" and args else path
        return self._call(name, str(target), lambda: inner(path, *args, **kwargs))

    method.__name__ = name
    return method


for _name in OPERATIONS:
    setattr(_DelegatingFileSystem, _name, _forward(_name))


class _UploadOnClose(io.BytesIO):
    """A write handle that uploads its whole content in one (retryable) request on close.

    Only an explicit ``close()`` (or leaving a ``with`` block normally) publishes. Leaving it by
    an exception, or dropping the handle without closing it (garbage collection), discards the
    content: a writer that failed half way never publishes half a file."""

    def __init__(self, upload: Callable[[bytes], Any]) -> None:
        super().__init__()
        self._upload = upload

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._upload(data)

    def discard(self) -> None:
        if not self.closed:
            super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        # io.IOBase.__del__ would call close(), publishing whatever was written so far.
        self.discard()


def innermost(fs: AbstractFileSystem) -> AbstractFileSystem:
    """The filesystem under every ftjob wrapper."""
    while isinstance(fs, _DelegatingFileSystem):
        fs = fs.fs
    return fs


class RetryingFileSystem(_DelegatingFileSystem):
    """Every operation on ``fs`` runs under ``policy``; counts land in ``stats``.

    ``inner_retries`` sets the request retries of the filesystem underneath (s3fs's
    ``retries`` attribute, which is no constructor argument and would be lost in pickling);
    it is a constructor argument here so that it survives the trip to Ray workers."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        policy: RetryPolicy,
        *,
        inner_retries: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fs)
        self.policy = policy
        self.stats = StorageStats()
        self._lock = threading.Lock()
        base = innermost(fs)
        if inner_retries is not None and hasattr(base, "retries"):
            base.retries = inner_retries

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        kind = OPERATIONS.get(op, "other")
        local = OpStats()
        # A missing file is an answer to a read or a listing, but a failure of an upload (no
        # such bucket).
        answers = () if kind == "upload" else (FileNotFoundError,)
        try:
            target = self.fs.unstrip_protocol(path)
            return self.policy.call(fn, op=op, target=target, stats=local, answers=answers)
        finally:
            with self._lock:
                self.stats.kind(kind).merge(local)

    def completed_requests(self) -> int:
        """Storage requests finished so far, retries included: progress, to hang detection."""
        with self._lock:
            return sum(stats.calls for stats in self.stats.by_kind.values())

    def snapshot_stats(self) -> StorageStats:
        with self._lock:
            copy = StorageStats()
            copy.merge(self.stats)
            return copy


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


class FaultInjectingFileSystem(_DelegatingFileSystem):
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
    while isinstance(inner, _DelegatingFileSystem):
        if isinstance(inner, FaultInjectingFileSystem):
            inner.set_stream(name)
            return
        inner = inner.fs


# -- construction -----------------------------------------------------------------------------


class StorageError(RuntimeError):
    """Checkpoint storage is unusable; the message names the path, bucket and what to do."""


INNER_RETRIES_OPTION = "retries"


def split_options(protocol: str, options: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """fsspec options for ``protocol``, and the retries of the filesystem's own retry loop.

    ftjob's policy is the one that retries, so the loops below it are switched off unless
    ``storage_options`` asks otherwise: s3fs's ``retries`` (an attribute, set on the instance;
    1 = one try) and botocore's (``config_kwargs.retries.total_max_attempts``: 1 = one try;
    botocore's ``max_attempts`` would count retries, not tries)."""
    merged = dict(options)
    inner_retries = merged.pop(INNER_RETRIES_OPTION, None)
    if protocol in ("s3", "s3a"):
        inner_retries = 1 if inner_retries is None else int(inner_retries)
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        merged["config_kwargs"] = config
    return merged, inner_retries


def build_filesystem(
    url: str,
    options: dict[str, Any],
    retry: RetryConfig,
    chaos: StorageChaosConfig | None = None,
    seed: int = 0,
) -> tuple[RetryingFileSystem, str]:
    """The retrying filesystem for ``url`` and the path within it."""
    protocol = fsspec.utils.get_protocol(url)
    fsspec_options, inner_retries = split_options(protocol, options)
    inner, path = fsspec.core.url_to_fs(url, **fsspec_options)
    fs: AbstractFileSystem = inner
    if chaos is not None and (chaos.failure_rate > 0 or chaos.upload_delay > 0):
        fs = FaultInjectingFileSystem(
            inner, chaos.failure_rate, chaos.errors, seed=seed, upload_delay=chaos.upload_delay
        )
    return RetryingFileSystem(fs, RetryPolicy(retry), inner_retries=inner_retries), path


def to_pyarrow(fs: AbstractFileSystem) -> Any:
    """Wrap for Ray Train's ``RunConfig(storage_filesystem=...)``."""
    import pyarrow.fs

    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def preflight(fs: RetryingFileSystem, path: str, key: str = "checkpoint.storage_path") -> None:
    """Write, read back and delete a probe object under ``path``, so a missing bucket, bad
    credentials or a read-only path fail now, in seconds, before Ray starts."""
    url = fs.unstrip_protocol(path)
    bucket = bucket_of(url)
    probe = f"{path.rstrip('/')}/.ftjob-probe-{uuid.uuid4().hex[:12]}"
    try:
        if not is_object_store(fs.protocol):
            # Object stores have no directories (and s3fs's makedirs would create the bucket).
            fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"ftjob storage probe")
        if fs.cat_file(probe) != b"ftjob storage probe":
            raise StorageError(f"{key}={url!r}: a probe object read back different bytes")
        fs.rm_file(probe)
    except StorageError:
        raise
    except Exception as exc:
        where = f"bucket {bucket!r} of {url!r}" if bucket else repr(url)
        options = f"{key.split('.')[0]}.storage_options"
        if bucket and isinstance(exc, FileNotFoundError):
            hint = f"bucket {bucket!r} does not exist: create it or fix {key}"
        elif isinstance(exc, PermissionError) or re.search(
            "credential|access ?key|signature|token", str(exc), re.IGNORECASE
        ):
            hint = (
                f"no permission to write to {where}: check credentials (AWS_* variables, {options})"
            )
        elif fs.policy.classifier.is_transient(exc):
            hint = (
                f"{where} did not answer after all retries: check the endpoint ({options}."
                "endpoint_url or AWS_ENDPOINT_URL) and the network"
            )
        else:
            hint = f"cannot write to {where}"
        raise StorageError(
            f"{key}={url!r}: {hint} ({type(exc).__name__}: {_one_line(exc)})"
        ) from exc
