"""Retrying storage: one retry policy (tenacity) over any fsspec filesystem.

Layers, outermost first::

    RetryingFileSystem(policy)        what Ray Train and ftjob's checkpoint store call
      FaultInjectingFileSystem(rate)  only when chaos.storage.failure_rate > 0
        fsspec filesystem             local, memory, s3 (s3fs), gcs (gcsfs), ...

The retrying layer is handed to Ray Train as a ``pyarrow.fs.PyFileSystem``, so every write,
read and listing of the run's storage goes through the same policy, and it pickles to workers
with that policy. The retry loops below it are switched off by default so that the policy users
configure is the one that acts: s3fs's ``retries`` and botocore's ``total_max_attempts`` are 1,
and so are gcsfs's request retries (``checkpoint.storage_options`` can set ``retries`` and
``config_kwargs.retries`` again). aiohttp still re-sends an idempotent request once when a
reused keep-alive connection turns out closed (RFC 9112); that is connection upkeep, not a
retry policy.

A wrapper answers every call as the filesystem it wraps would (fsspec's own conformance suite
runs on it, tests/test_fs_conformance.py): each operation goes to the filesystem's own
implementation where it has one (see :data:`PRIMITIVES`). Two things differ, on purpose: a
write handle uploads its whole content in one request on close (a writer that fails half way
publishes nothing), and ``pipe_file(mode="create")`` / ``open(path, "x")`` are exclusive
creates wherever the backend allows (:func:`exclusive_create_guarantee`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import random
import re
import threading
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftjob.config import RetryConfig, StorageChaosConfig
from ftjob.retry import OpStats, RetryPolicy, StorageStats, _one_line
from ftjob.urls import bucket_of, is_object_store

logger = logging.getLogger("ftjob.storage")

# -- filesystem wrappers ----------------------------------------------------------------------

# Operation name -> kind (for stats). Two sorts, so that a wrapper answers every call as the
# filesystem below it would:
#
# - PRIMITIVES are what a backend implements: always one call to the filesystem below, retried
#   as a whole.
# - The others are fsspec compositions (copy a tree, expand a glob, exists via info, ...). Where
#   the filesystem below implements one itself (s3fs: nearly all, as batched async calls; local:
#   rm, mv, touch, modified, ...), that implementation is called, retried as a whole. Where it
#   inherits fsspec's generic version, the same generic version runs on the wrapper, over the
#   wrapper's primitives: the same result, and each request of a bulk operation is retried on
#   its own instead of the whole operation being started again.
PRIMITIVES: dict[str, str] = {
    "pipe_file": "upload",
    "put_file": "upload",
    "cat_file": "download",
    "get_file": "download",
    "ls": "list",
    "info": "list",
    "mkdir": "other",
    "makedirs": "other",
    "rmdir": "delete",
    "rm_file": "delete",
    "cp_file": "other",
}
COMPOSITES: dict[str, str] = {
    "pipe": "upload",
    "put": "upload",
    "upload": "upload",
    "touch": "upload",
    "write_bytes": "upload",
    "write_text": "upload",
    "cat": "download",
    "cat_ranges": "download",
    "get": "download",
    "download": "download",
    "head": "download",
    "tail": "download",
    "read_bytes": "download",
    "read_text": "download",
    "read_block": "download",
    "find": "list",
    "glob": "list",
    "expand_path": "list",
    "exists": "list",
    "lexists": "list",
    "isdir": "list",
    "isfile": "list",
    "listdir": "list",
    "stat": "list",
    "du": "list",
    "disk_usage": "list",
    "size": "list",
    "sizes": "list",
    "modified": "list",
    "created": "list",
    "checksum": "list",
    "ukey": "list",
    "sign": "other",
    "copy": "other",
    "cp": "other",
    "mv": "other",
    "move": "other",
    "rename": "other",
    "makedir": "other",
    "mkdirs": "other",
    "rm": "delete",
    "delete": "delete",
}
OPERATIONS: dict[str, str] = {**PRIMITIVES, **COMPOSITES}

# Where an operation names its storage path, as (keyword names, position); the default is
# ``path``, first. Between local and storage it is the storage side: s3fs and fsspec call it
# ``rpath``, the local filesystem ``path1``/``path2``.
_PATH_ARGUMENTS: dict[str, tuple[tuple[str, ...], int]] = {
    "put_file": (("rpath", "path2"), 1),
    "put": (("rpath", "path2"), 1),
    "upload": (("rpath", "path2"), 1),
    "get_file": (("rpath", "path1"), 0),
    "get": (("rpath", "path1"), 0),
    "download": (("rpath", "path1"), 0),
    "cp_file": (("path1",), 0),
    "copy": (("path1",), 0),
    "cp": (("path1",), 0),
    "mv": (("path1",), 0),
    "move": (("path1",), 0),
    "rename": (("path1",), 0),
    "cat_ranges": (("paths",), 0),
    "sizes": (("paths",), 0),
    "read_block": (("fn",), 0),
}


def _storage_path(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The storage path a call names, positional or keyword, as text for logs and errors
    (the first of several, with a count)."""
    names, position = _PATH_ARGUMENTS.get(op, (("path",), 0))
    path = next((kwargs[n] for n in names if n in kwargs), None)
    if path is None and len(args) > position:
        path = args[position]
    if isinstance(path, dict):  # pipe({path: data, ...})
        path = list(path)
    if isinstance(path, (list, tuple)):
        if not path:
            return ""
        more = f" (+{len(path) - 1} more)" if len(path) > 1 else ""
        return f"{path[0]}{more}"
    return "" if path is None else str(path)


def _implements(fs: AbstractFileSystem, name: str) -> bool:
    """Does the filesystem under every ftjob wrapper implement ``name`` itself, rather than
    inherit fsspec's generic version? (Async filesystems install their sync methods on the
    instance, so the instance is what is asked.)"""
    impl = getattr(innermost(fs), name, None)
    generic = getattr(AbstractFileSystem, name, None)
    return impl is not None and getattr(impl, "__func__", impl) is not generic


class _DelegatingFileSystem(AbstractFileSystem):
    """An fsspec filesystem that forwards every operation in OPERATIONS to ``self.fs``
    through :meth:`_call`. Subclasses decide what happens around the call."""

    cachable = False

    def __init__(self, fs: AbstractFileSystem, **kwargs: Any) -> None:
        super().__init__()
        self.fs = fs
        self.protocol = fs.protocol
        # fsspec's generic methods, when they run here, read these from ``self``.
        self.root_marker = fs.root_marker
        self.sep = fs.sep

    def unstrip_protocol(self, name: str) -> str:
        return self.fs.unstrip_protocol(name)

    def _strip_protocol(self, path: Any) -> Any:  # type: ignore[override]
        return self.fs._strip_protocol(path)

    def _parent(self, path: str) -> str:  # type: ignore[override]
        # fsspec's is a classmethod over the class's _strip_protocol; ours is the instance's.
        return self.fs._parent(path)

    def _isfilestore(self) -> bool:
        return self.fs._isfilestore()

    @property
    def fsid(self) -> str:
        return self.fs.fsid

    def invalidate_cache(self, path: str | None = None) -> None:
        # s3fs caches listings; a wrapper that kept them would answer from a stale cache.
        self.fs.invalidate_cache(path)

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def pipe_file(self, *args: Any, **kwargs: Any) -> Any:
        target = _storage_path("pipe_file", args, kwargs)
        return self._call("pipe_file", target, self._pipe(args, kwargs))

    def _pipe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
        """The call to the filesystem below for ``pipe_file(*args, **kwargs)``: with
        ``mode="create"`` directly above a backend that does not create atomically itself,
        an exclusive create done here (see :func:`exclusive_create_guarantee`)."""
        path, data, mode = _pipe_arguments(args, kwargs)
        base = self.fs
        if isinstance(base, LocalFileSystem) and mode != "create":
            return lambda: _replace_local(base, path, data)
        if mode == "create" and not isinstance(base, _DelegatingFileSystem):
            if isinstance(base, LocalFileSystem):
                return lambda: _create_local(base, path, data)
            if isinstance(base, MemoryFileSystem):
                return lambda: _create_in_memory(base, path, data)
            if not _protocols(base) & ATOMIC_CREATE_PROTOCOLS:
                return lambda: _create_after_check(base, args, kwargs)
        return lambda: base.pipe_file(*args, **kwargs)

    def walk(self, *args: Any, **kwargs: Any) -> Any:
        # A generator cannot be retried half way: the filesystem's own walk (s3fs has one)
        # runs as it is; fsspec's generic one runs here, each listing retried.
        if _implements(self.fs, "walk"):
            return self.fs.walk(*args, **kwargs)
        return AbstractFileSystem.walk(self, *args, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            return _ReadHandle(self.cat_file(path), path, mode)
        if "a" in mode:
            raise NotImplementedError(f"append mode is not supported on {type(self).__name__}")
        if "x" in mode:
            # Refused now, like open(path, "x"); the create on close is exclusive as well, so
            # a writer that got in between loses nothing.
            if self.exists(path):
                raise FileExistsError(
                    errno.EEXIST, os.strerror(errno.EEXIST), self.unstrip_protocol(path)
                )
            return _UploadOnClose(lambda data: self.pipe_file(path, data, mode="create"))
        return _UploadOnClose(lambda data: self.pipe_file(path, data))


def _forward(name: str, primitive: bool) -> Callable[..., Any]:
    generic = getattr(AbstractFileSystem, name)

    def method(self: _DelegatingFileSystem, *args: Any, **kwargs: Any) -> Any:
        if not primitive and not _implements(self.fs, name):
            return generic(self, *args, **kwargs)
        inner = getattr(self.fs, name)
        return self._call(name, _storage_path(name, args, kwargs), lambda: inner(*args, **kwargs))

    method.__name__ = name
    method.__qualname__ = f"_DelegatingFileSystem.{name}"
    method.__doc__ = generic.__doc__
    return method


for _name in OPERATIONS:
    if _name not in vars(_DelegatingFileSystem):
        setattr(_DelegatingFileSystem, _name, _forward(_name, _name in PRIMITIVES))


def _protocols(fs: AbstractFileSystem) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


# Backends whose own pipe_file(mode="create") is a conditional write the store decides.
ATOMIC_CREATE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})


def _pipe_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, str]:
    """(path, data, mode) of a pipe_file call, by fsspec's names (``value``) or s3fs's
    (``data``); ``mode`` by keyword, or positional where it can only be the mode."""
    path = kwargs["path"] if "path" in kwargs else (args[0] if args else None)
    data = kwargs.get("value", kwargs.get("data"))
    if data is None and len(args) > 1:
        data = args[1]
    mode = kwargs.get("mode")
    if mode is None:
        mode = next((a for a in args[2:] if isinstance(a, str)), "overwrite")
    return path, data, mode


# link(2) on a filesystem without hard links (vfat, some FUSE mounts) fails with one of these.
_NO_HARD_LINKS = {
    getattr(errno, name)
    for name in ("EPERM", "ENOSYS", "EXDEV", "ENOTSUP", "EOPNOTSUPP")
    if hasattr(errno, name)
}


def _create_local(fs: LocalFileSystem, path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` only if it does not exist, atomically: the bytes go to a
    temporary file in the same directory, which is then hard-linked to ``path`` -- ``link``
    fails with EEXIST if ``path`` exists, and no reader ever sees the file half written. This
    holds on NFS and other shared filesystems too (link is the classic NFS-safe exclusive
    create). Where the filesystem has no hard links (some FUSE mounts), ``O_EXCL`` does the
    exclusive part; a reader may then see the file before it is complete."""
    path = fs._strip_protocol(path)
    directory = os.path.dirname(path) or "."
    if fs.auto_mkdir:
        os.makedirs(directory, exist_ok=True)
    temp = os.path.join(
        directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.ftjob-create"
    )
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(temp, flags, 0o666)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path) from None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            _create_in_place(path, data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _replace_local(fs: LocalFileSystem, path: str, data: bytes) -> None:
    """Write ``path`` atomically: a temporary file in the same directory, flushed, renamed
    over it. A reader (another worker checking the run lease, a restore reading a manifest)
    sees the old content or the new, never a truncated file."""
    path = fs._strip_protocol(path)
    directory = os.path.dirname(path) or "."
    if fs.auto_mkdir:
        os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.ftjob-write")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _create_in_place(path: str, data: bytes) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(path, flags, 0o666), "wb") as f:
        f.write(data)


# The memory filesystem's own create is a check, then a write: one lock makes the two one step
# for every writer that goes through ftjob in this process (its store is per process anyway).
_MEMORY_CREATE_LOCK = threading.Lock()


def _create_in_memory(fs: MemoryFileSystem, path: str, data: bytes) -> None:
    with _MEMORY_CREATE_LOCK:
        fs.pipe_file(path, data, mode="create")


def _create_after_check(
    fs: AbstractFileSystem, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Best effort where the backend has no atomic create: refuse an existing file even if the
    backend's own pipe_file ignores ``mode``."""
    path, _, _ = _pipe_arguments(args, kwargs)
    if fs.exists(path):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    return fs.pipe_file(*args, **kwargs)


def exclusive_create_guarantee(fs: AbstractFileSystem) -> str:
    """What ``fs.pipe_file(path, data, mode="create")`` guarantees on ``fs``'s backend, in
    words: whether two writers racing for the same new path can both believe they made it."""
    base = innermost(fs)
    if isinstance(base, LocalFileSystem):
        return "atomic exclusive create (local filesystem: link)"
    if isinstance(base, MemoryFileSystem):
        return "atomic within one process (memory filesystem)"
    protocols = _protocols(base)
    if protocols & {"s3", "s3a"}:
        return "conditional write If-None-Match: * (s3)"
    if protocols & {"gs", "gcs"}:
        return "gcs: generation precondition (if-generation-match=0)"
    name = base.protocol if isinstance(base.protocol, str) else base.protocol[0]
    return f"best effort: exists check then write (no atomic create on {name})"


class _ReadHandle(io.BytesIO):
    """A whole file, read in one (retryable) request. ``size``, ``path`` and ``mode`` as an
    fsspec file has them (fsspec's generic ``tail`` and ``read_block`` read ``size``)."""

    def __init__(self, data: bytes, path: str, mode: str) -> None:
        super().__init__(data)
        self.size, self.path, self.mode = len(data), path, mode


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
        if inner_retries is not None:
            set_inner_retries(innermost(fs), inner_retries)

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        kind = OPERATIONS.get(op, "other")
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
