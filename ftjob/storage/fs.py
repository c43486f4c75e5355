"""Retrying storage: one retry policy (tenacity) over any fsspec filesystem.

Layers, outermost first::

    RetryingFileSystem(policy)        what Ray Train and ftjob's checkpoint store call
      FaultInjectingFileSystem(rate)  only when chaos.storage.failure_rate > 0 (faults.py)
        fsspec filesystem             local, memory, s3 (s3fs), gcs (gcsfs), ...

The retrying layer is handed to Ray Train as a ``pyarrow.fs.PyFileSystem``, so every write,
read and listing of the run's storage goes through the same policy, and it pickles to workers
with that policy. The retry loops below it are switched off by default so that the policy users
configure is the one that acts: s3fs's ``retries`` and botocore's ``total_max_attempts`` are 1,
and so are gcsfs's request retries (``checkpoint.storage_options`` can set ``retries`` and
``config_kwargs.retries`` again). aiohttp still re-sends an idempotent request once when a
reused keep-alive connection turns out closed (RFC 9112); that is connection upkeep, not a
retry policy. How a wrapper behaves like the filesystem it wraps: :mod:`ftjob.storage.wrapper`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from ftjob.config import RetryConfig, StorageChaosConfig
from ftjob.storage.faults import FaultInjectingFileSystem
from ftjob.storage.retry import OpStats, RetryPolicy, StorageStats, _one_line
from ftjob.storage.urls import bucket_of, is_object_store
from ftjob.storage.wrapper import (
    OPERATIONS,
    DelegatingFileSystem,
    _pipe_arguments,
    _protocols,
    _storage_path,
    innermost,
)

logger = logging.getLogger("ftjob.storage.fs")


class RetryingFileSystem(DelegatingFileSystem):
    """Every operation on ``fs`` runs under ``policy``; counts land in ``stats``.

    ``inner_retries`` sets the tries of the retry loop of the filesystem underneath (s3fs's
    ``retries`` attribute, gcsfs's retrying request methods; see :func:`set_inner_retries`),
    which no constructor argument of theirs sets and pickling would lose; it is a constructor
    argument here so that it survives the trip to Ray workers."""

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
        self._guard = threading.local()
        if inner_retries is not None:
            set_inner_retries(innermost(fs), inner_retries)

    @contextlib.contextmanager
    def guarded(self, check: Callable[[], None]) -> Iterator[None]:
        """Inside, on this thread, ``check()`` runs before every retry of every call: what it
        raises (a lost run lease) ends the call instead of the next try."""
        previous = getattr(self._guard, "check", None)
        self._guard.check = check
        try:
            yield
        finally:
            self._guard.check = previous

    def _unguarded(self, check: Callable[[], None]) -> None:
        """Run ``check`` with this thread's guard off: its own requests (the lease's, often on
        this very filesystem) retry as any request does, never by checking again."""
        self._guard.check = None
        try:
            check()
        finally:
            self._guard.check = check

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        kind = OPERATIONS.get(op, "other")
        check = getattr(self._guard, "check", None)
        if check is not None:
            fn = _checked_retries(fn, lambda: self._unguarded(check))
        local = OpStats()
        # A missing file is an answer to a read or a listing, but a failure of an upload (no
        # such bucket).
        answers = () if kind == "upload" else (FileNotFoundError,)
        try:
            target = self.fs.unstrip_protocol(path) if path else path
            return self.policy.call(fn, op=op, target=target, stats=local, answers=answers)
        finally:
            with self._lock:
                self.stats.kind(kind).merge(local)

    def pipe_file(self, *args: Any, **kwargs: Any) -> Any:
        path, data, mode = _pipe_arguments(args, kwargs)
        if mode != "create":
            return super().pipe_file(*args, **kwargs)
        create = self._pipe(args, kwargs)
        tries = 0

        def create_once() -> Any:
            # Retried only after a transient error: the earlier try may have created the file
            # and lost its answer. Holding our own bytes, the file is ours.
            nonlocal tries
            tries += 1
            try:
                return create()
            except FileExistsError:
                if tries > 1 and self._holds(path, data):
                    return None
                raise

        return self._call("pipe_file", _storage_path("pipe_file", args, kwargs), create_once)

    def _holds(self, path: str, data: Any) -> bool:
        try:
            return bool(self.fs.cat_file(path) == bytes(data))
        except Exception:
            return False

    def completed_requests(self) -> int:
        """Storage requests finished so far, retries included: progress, to hang detection."""
        with self._lock:
            return sum(stats.calls for stats in self.stats.by_kind.values())

    def snapshot_stats(self) -> StorageStats:
        with self._lock:
            copy = StorageStats()
            copy.merge(self.stats)
            return copy


# -- construction -----------------------------------------------------------------------------


class StorageError(RuntimeError):
    """Checkpoint storage is unusable; the message names the path, bucket and what to do."""


INNER_RETRIES_OPTION = "retries"
GCS_PROTOCOLS = ("gs", "gcs")
# gcsfs retries inside these coroutines, by its ``retry_request`` decorator, which fixes the
# number of tries when the class is defined (``retries = 6``): setting the ``retries``
# attribute of an instance changes nothing. The undecorated coroutine is ``__wrapped__``.
GCSFS_RETRYING_METHODS = ("_request", "_get_file_request", "_get_file_concurrent")


def split_options(protocol: str, options: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """fsspec options for ``protocol``, and the tries of the filesystem's own retry loop.

    ftjob's policy is the one that retries, so the loops below it are switched off unless
    ``storage_options`` asks otherwise (``retries``: tries per request, 1 = one try): s3fs's
    ``retries`` and botocore's (``config_kwargs.retries.total_max_attempts``: 1 = one try;
    botocore's ``max_attempts`` would count retries, not tries), and gcsfs's request retries
    (see :data:`GCSFS_RETRYING_METHODS`)."""
    merged = dict(options)
    inner_retries = merged.pop(INNER_RETRIES_OPTION, None)
    if protocol in ("s3", "s3a"):
        inner_retries = 1 if inner_retries is None else int(inner_retries)
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        merged["config_kwargs"] = config
    elif protocol in GCS_PROTOCOLS:
        inner_retries = 1 if inner_retries is None else int(inner_retries)
    return merged, inner_retries


def set_inner_retries(fs: AbstractFileSystem, tries: int) -> None:
    """Set the tries of ``fs``'s own retry loop (on the instance; 1 = one try)."""
    if _protocols(fs) & set(GCS_PROTOCOLS):
        for name in GCSFS_RETRYING_METHODS:
            original = getattr(getattr(type(fs), name, None), "__wrapped__", None)
            if original is None:
                logger.warning(
                    "cannot set the request retries of %s: it has no retrying %s",
                    type(fs).__name__,
                    name,
                )
                continue
            if tries > 1:
                from gcsfs.retry import retry_request

                original = retry_request(retries=tries)(original)
            setattr(fs, name, types.MethodType(original, fs))
    if hasattr(fs, "retries"):
        fs.retries = tries


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


def _checked_retries(fn: Callable[[], Any], check: Callable[[], None]) -> Callable[[], Any]:
    """``fn`` with ``check()`` before each call but the first."""
    tries = 0

    def call() -> Any:
        nonlocal tries
        tries += 1
        if tries > 1:
            check()
        return fn()

    return call
