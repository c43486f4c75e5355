"""A filesystem wrapper that answers every call as the filesystem it wraps would (fsspec's own
conformance suite runs on it, tests/unit/storage/test_fs_conformance.py): each operation goes to
the filesystem's own implementation where it has one (see :data:`PRIMITIVES`). Two things differ,
on purpose: a write handle uploads its whole content in one request on close (a writer that
fails half way publishes nothing), and ``pipe_file(mode="create")`` / ``open(path, "x")`` are
exclusive creates wherever the backend allows (:func:`exclusive_create_guarantee`); local
overwrites are atomic (a temporary file renamed over the target). Subclasses decide what
happens around each call (retries, injected faults).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

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


class DelegatingFileSystem(AbstractFileSystem):
    """An fsspec filesystem that forwards every operation in OPERATIONS to ``self.fs``
    through :meth:`_call`. Subclasses decide what happens around the call (retries in
    :class:`~ftjob.storage.fs.RetryingFileSystem`, injected faults in
    :class:`~ftjob.storage.faults.FaultInjectingFileSystem`)."""

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

    def _strip_protocol(self, path: Any) -> Any:
        return self.fs._strip_protocol(path)

    def _parent(self, path: str) -> str:
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
        if mode == "create" and not isinstance(base, DelegatingFileSystem):
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

    def method(self: DelegatingFileSystem, *args: Any, **kwargs: Any) -> Any:
        if not primitive and not _implements(self.fs, name):
            return generic(self, *args, **kwargs)
        inner = getattr(self.fs, name)
        return self._call(name, _storage_path(name, args, kwargs), lambda: inner(*args, **kwargs))

    method.__name__ = name
    method.__qualname__ = f"DelegatingFileSystem.{name}"
    method.__doc__ = generic.__doc__
    return method


for _name in OPERATIONS:
    if _name not in vars(DelegatingFileSystem):
        setattr(DelegatingFileSystem, _name, _forward(_name, _name in PRIMITIVES))


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
        self.size, self.path, self._mode = len(data), path, mode

    @property
    def mode(self) -> str:  # a BytesIO has none; typing's IO declares it read-only
        return self._mode


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
    while isinstance(fs, DelegatingFileSystem):
        fs = fs.fs
    return fs
