"""Atomic checkpoints on any fsspec storage: a checkpoint counts only when its manifest exists
and the files it names are confirmed.

A checkpoint is a directory ``{run}/checkpoints/step_{step:09d}/`` holding the files the
training loop wrote plus ``manifest.json`` -- each file's size and SHA-256 -- published *last*.
Restoring downloads the newest checkpoint and verifies it against its manifest; an incomplete
or corrupt one (missing manifest, missing or truncated file, checksum mismatch) is skipped,
logged, and the next older one is tried. What does not verify is moved to
``{run}/quarantine/`` with a note, never deleted.

**A zombie writer cannot touch a live writer's checkpoint.** Every commit uploads its files
under object names of its own -- ``model.g{generation}a{attempt}-{random}.pt``: the run lease's
generation, the attempt, a random part -- so no upload ever replaces an object another writer
wrote, however late it lands. Files become a checkpoint only through the manifest that names
them, and a manifest is published by an exclusive create, or replaces only a manifest of an
*older* writer (lower generation, or the same generation's earlier attempt): a deposed
driver or a previous attempt's rank 0 that wakes up finds the newer writer's manifest and
stops. The run lease's fence runs before the first upload, before every retry of every
request of the commit, and before the manifest.

**Retention and quarantine never remove the newest checkpoint that verifies.** Before its
manifest is published a commit confirms its files by one listing (every object there, with its
size); :meth:`CheckpointStore.prune` keeps every checkpoint down to the ``keep``-th one that
verifies (manifest against one listing of sizes), so a newest checkpoint that is damaged,
truncated or half-written never costs an older good one. Quarantine is fenced, leaves alone a
directory without a manifest whose newest object is younger than ``settle_s`` (an upload
still in flight: the lease timeout), moves by rename where the filesystem has one (no space
needed), and on object stores deletes only the objects it copied. A quarantine that fails is
said, and the restore goes on.

Nothing here hands fsspec a pattern: its recursive ``rm``/``mv`` glob-expand their path on
object stores and the memory filesystem (``run[1]`` would match ``run1``), so directories are
deleted and moved as the files a listing returned, one by one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ftjob.storage.errors import is_storage_error
from ftjob.storage.lease import LeaseLost
from ftjob.storage.urls import is_object_store

logger = logging.getLogger("ftjob.storage.checkpoint")

MANIFEST = "manifest.json"  # format 1's one manifest; format 2: manifest.<writer tag>.json
_MANIFEST_FILE = re.compile(r"^manifest(?:\.g(\d+)a(-?\d+)-([0-9a-f]+))?\.json$")
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"  # beside checkpoints/: directories that did not verify
QUARANTINE_NOTE = "QUARANTINED.json"
FORMAT = 2  # 1: files stored under their own names, no writer
_STEP_DIR = re.compile(r"^step_(\d{9})$")
_CHUNK = 8 * 1024 * 1024


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Writer:
    """Who commits a checkpoint: the run lease's generation (a driver) and the attempt (a
    worker group of that driver). A newer writer is a higher ``key``; ``tag`` makes its object
    names its own."""

    generation: int = 0
    attempt: int = 0
    nonce: str = ""

    @property
    def key(self) -> tuple[int, int]:
        return (self.generation, self.attempt)

    @property
    def tag(self) -> str:
        return f"g{self.generation}a{self.attempt}-{self.nonce}"

    def object_name(self, name: str) -> str:
        """``model.pt`` -> ``model.g3a1-5f0c2e9a.pt``: the name this writer stores it under."""
        stem, ext = posixpath.splitext(name)
        return f"{stem}.{self.tag}{ext}"

    @property
    def manifest(self) -> str:
        """The name this writer publishes its manifest under (created, never replaced)."""
        return f"manifest.{self.tag}.json"

    def as_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "attempt": self.attempt, "nonce": self.nonce}

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> Writer:
        """The writer a manifest names (a format-1 manifest: the oldest possible)."""
        record = manifest.get("writer")
        if not isinstance(record, dict):
            return cls()
        generation, attempt = record.get("generation"), record.get("attempt")
        if not isinstance(generation, int) or not isinstance(attempt, int):
            return cls()
        return cls(generation, attempt, str(record.get("nonce", "")))


def build_manifest(local_dir: str, step: int, writer: Writer | None = None) -> dict[str, Any]:
    writer = writer or Writer(nonce=secrets.token_hex(4))
    files = {}
    for name in sorted(os.listdir(local_dir)):
        full = os.path.join(local_dir, name)
        if _MANIFEST_FILE.match(name) or not os.path.isfile(full):
            continue
        files[name] = {
            "size": os.path.getsize(full),
            "sha256": file_digest(full),
            "object": writer.object_name(name),
        }
    return {
        "format": FORMAT,
        "step": step,
        "created": time.time(),
        "writer": writer.as_json(),
        "files": files,
    }


def object_of(name: str, meta: dict[str, Any]) -> str:
    """Where a manifest's file is stored in its directory."""
    return str(meta.get("object", name))


def _is_local(fs: AbstractFileSystem) -> bool:
    from ftjob.storage.wrapper import innermost

    return "file" in _protocols(innermost(fs))


def _protocols(fs: AbstractFileSystem) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def _sync(path: str) -> None:
    """Flush a local file (or directory entry) to the disk: on local and shared filesystems a
    manifest must never be durable before the files it vouches for."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(fs: AbstractFileSystem, root: str) -> tuple[list[str], list[str]]:
    """(files, directories) under directory ``root`` (stripped of its protocol), from a
    listing; entries outside it are refused, not touched."""
    try:
        found = fs.find(root, withdirs=True, detail=True)
    except FileNotFoundError:
        return [], []
    files, dirs = [], []
    for name, info in found.items():
        if not str(name).startswith(root + "/"):
            continue
        (dirs if info.get("type") == "directory" else files).append(str(name))
    return sorted(files), sorted(dirs)


def _sizes(fs: AbstractFileSystem, directory: str) -> dict[str, int]:
    """The objects directly in ``directory`` and their sizes, from one fresh listing."""
    try:
        entries = fs.ls(directory, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {
        posixpath.basename(str(e["name"]).rstrip("/")): int(e.get("size") or 0)
        for e in entries
        if e.get("type") != "directory"
    }


def manifest_of(names: Iterable[str]) -> str | None:
    """Of the file names in a checkpoint directory, its manifest: the newest writer's
    (highest lease generation, then attempt; format 1's ``manifest.json`` is the oldest). A
    late manifest of an older writer is never the checkpoint's."""
    ranked = []
    for name in names:
        found = _MANIFEST_FILE.match(name)
        if found:
            generation, attempt, nonce = found.groups()
            key = (-1, -1, "") if generation is None else (int(generation), int(attempt), nonce)
            ranked.append((key, name))
    return max(ranked)[1] if ranked else None


def _remove_files(fs: AbstractFileSystem, root: str, files: list[str], dirs: list[str]) -> None:
    """Delete exactly ``files`` (from a listing of ``root``), then -- on filesystems with
    directories -- those of ``dirs`` and ``root`` that are empty now, deepest first: a file
    that arrived since the listing stays, and so does its directory."""
    for name in files:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(name)
    if not is_object_store(fs.protocol):
        for d in sorted([*dirs, root], key=len, reverse=True):
            with contextlib.suppress(OSError):
                fs.rmdir(d)


def remove_tree(fs: AbstractFileSystem, path: str) -> None:
    """Delete directory ``path``: the files a listing returned, one by one, then (on
    filesystems with directories) the emptied directories, deepest first."""
    root = fs._strip_protocol(path).rstrip("/")
    _remove_files(fs, root, *_listing(fs, root))


def move_tree(fs: AbstractFileSystem, source: str, destination: str) -> None:
    """Move directory ``source`` to ``destination`` (which must not exist). On a local
    filesystem one rename (atomic, and it needs no free space); elsewhere each listed file
    copied, then exactly the copied files deleted -- never a pattern, nothing deleted before
    its copy exists, and a file that arrived in between stays where it is."""
    root = fs._strip_protocol(source).rstrip("/")
    target = fs._strip_protocol(destination).rstrip("/")
    if _is_local(fs):
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        os.rename(root, target)
        return
    files, dirs = _listing(fs, root)
    if not is_object_store(fs.protocol):
        fs.makedirs(target, exist_ok=True)
    for name in files:
        relative = name[len(root) + 1 :]
        if not is_object_store(fs.protocol) and "/" in relative:
            fs.makedirs(posixpath.dirname(posixpath.join(target, relative)), exist_ok=True)
        fs.cp_file(name, posixpath.join(target, relative))
    _remove_files(fs, root, files, dirs)


def checkpoint_file(url: str, name: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of file ``name`` (``model.pt``, ``state.json``...) of the checkpoint directory
    at ``url`` -- summary.json's ``checkpoints.latest`` -- found through its manifest and
    checked against its size and SHA-256. Raises :class:`CorruptCheckpoint`."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    step = CheckpointStore.step_of(path)
    if step is None:
        raise CorruptCheckpoint(f"{url} is not a checkpoint directory (step_NNNNNNNNN)")
    store = CheckpointStore(fs, posixpath.dirname(posixpath.dirname(path.rstrip("/"))))
    manifest = store.read_manifest(step)
    data = store.read_file(step, name, manifest)
    meta = manifest["files"][name]
    if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise CorruptCheckpoint(f"{name} of {url} does not match its manifest")
    return data


def written_ago(fs: AbstractFileSystem, directory: str, probe_dir: str) -> float | None:
    """Seconds since the newest object under ``directory`` was written, on the store's clock
    (against a probe written to ``probe_dir`` now); None when it holds none."""
    files, _ = _listing(fs, fs._strip_protocol(directory).rstrip("/"))
    if not files:
        return None
    newest = max(fs.modified(name) for name in files)
    probe = posixpath.join(probe_dir, f".clock-{secrets.token_hex(6)}")
    fs.pipe_file(probe, b"")
    try:
        return float((fs.modified(probe) - newest).total_seconds())
    finally:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(probe)


class CorruptCheckpoint(Exception):
    """A checkpoint that is incomplete or does not match its manifest."""


class UncommittedCheckpoint(CorruptCheckpoint):
    """A directory without a manifest: an upload that never completed (never a checkpoint)."""


class StepTaken(LeaseLost):
    """A newer writer (a later driver, or a later attempt of this one) committed this step:
    this writer is a zombie and stops."""


def _plain(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not _MANIFEST_FILE.match(name)
        and "/" not in name
        and "\\" not in name
    )


def _check_manifest(manifest: Any, step: int) -> None:
    """A manifest names plain files (no paths: they are joined to local directories) with a
    size, a checksum and the plain name it is stored under, for the step of the directory it
    is in."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CorruptCheckpoint("malformed manifest: no file table")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(f"manifest is for step {manifest.get('step')}, not {step}")
    for name, meta in files.items():
        if not _plain(name) or not isinstance(meta, dict) or not _plain(object_of(name, meta)):
            raise CorruptCheckpoint(f"malformed manifest entry {name!r}")
        if not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
            raise CorruptCheckpoint(f"manifest entry {name!r} lacks a size or a checksum")


def _check_sizes(manifest: dict[str, Any], sizes: dict[str, int]) -> None:
    """Every file of ``manifest`` listed with its size (the cheap verification: one listing)."""
    for name, meta in manifest["files"].items():
        stored = object_of(name, meta)
        if stored not in sizes:
            raise CorruptCheckpoint(f"{name} is missing")
        if sizes[stored] != meta["size"]:
            raise CorruptCheckpoint(
                f"{name} has {sizes[stored]} bytes, manifest says {meta['size']}"
            )


@dataclass(frozen=True)
class RestoreChoice:
    """What rank 0 chose to restore, as every rank receives it: a durable checkpoint (rank 0
    downloaded and verified it into ``local_dir``; what a newer one did not verify is in
    ``set_aside``) or a memory snapshot (``digests``: rank 0's, which every rank's copy must
    match; ``node``: the node whose holder rank 0 read it from, which every rank can fetch
    it from when its own node's holder has no such copy)."""

    step: int
    path: str
    tier: str = "storage"  # or "memory"
    local_dir: str | None = None
    set_aside: tuple[dict[str, Any], ...] = ()
    digests: tuple[tuple[str, str], ...] = ()
    node: str | None = None


@dataclass
class RestoreResult:
    step: int
    path: str
    local_dir: str
    skipped: list[dict[str, Any]] = field(default_factory=list)


class CheckpointStore:
    """Writes, lists, verifies, quarantines and prunes the checkpoints of one run on ``fs``.

    ``fence`` raises (:class:`~ftjob.storage.lease.LeaseLost`) once this driver no longer holds
    the run; its ``generation`` (a :class:`~ftjob.storage.lease.LeaseFence`'s) and ``attempt``
    make this store's :class:`Writer`. ``settle_s``: how long a directory without a manifest
    may still be written by an upload in flight (the lease timeout)."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        run_path: str,
        fence: Callable[[], None] | None = None,
        *,
        attempt: int = 0,
        settle_s: float = 60.0,
    ) -> None:
        self.fs = fs
        self.root = posixpath.join(run_path.rstrip("/"), CHECKPOINTS_DIR)
        self.fence = fence or (lambda: None)
        self.generation = int(getattr(fence, "generation", 0) or 0)
        self.attempt, self.settle_s = attempt, settle_s
        self._confirmed: int | None = None  # the step this store last committed (listed)
        self._commits = 0

    def dir_name(self, step: int) -> str:
        return f"step_{step:09d}"

    def path_for(self, step: int) -> str:
        return posixpath.join(self.root, self.dir_name(step))

    def manifest_path(self, step: int) -> str:
        """The manifest that makes ``step``'s directory a checkpoint (the newest writer's);
        where format 1's would be when it has none."""
        name = manifest_of(_sizes(self.fs, self.path_for(step)))
        return posixpath.join(self.path_for(step), name or MANIFEST)

    # -- write ----------------------------------------------------------------------------

    def writer(self) -> Writer:
        """A fresh writer identity for one commit (its objects' names are its own); its nonce
        starts with this store's commit count, so of two commits of one step by one writer
        the later one's manifest ranks higher."""
        self._commits += 1
        return Writer(self.generation, self.attempt, f"{self._commits:06x}{secrets.token_hex(3)}")

    @contextlib.contextmanager
    def _fenced_retries(self) -> Iterator[None]:
        """Every retry of every request inside runs the fence first (a retrying filesystem's
        guard), so a writer that lost the run stops retrying at once."""
        guarded = getattr(self.fs, "guarded", None)
        with guarded(self.fence) if guarded is not None else contextlib.nullcontext():
            yield

    def commit(self, local_dir: str, step: int) -> str:
        """Upload ``local_dir`` as the checkpoint of ``step``: every file under this writer's
        own names, confirmed by one listing, then the manifest (created under this writer's
        name too: nothing is replaced), confirmed by another. Raises when an
        upload fails after the retry policy gave up (the checkpoint then has no manifest and
        never counts), :class:`~ftjob.storage.lease.LeaseLost` when the run is no longer this
        driver's, and :class:`StepTaken` when a newer writer committed this step."""
        manifest = build_manifest(local_dir, step, self.writer())
        remote = self.path_for(step)
        local = _is_local(self.fs)
        with self._fenced_retries():
            self.fence()
            if not is_object_store(self.fs.protocol):
                # Not on object stores: there s3fs's makedirs costs requests and would even
                # re-create a bucket deleted under a running job.
                self.fs.makedirs(remote, exist_ok=True)
            for name, meta in manifest["files"].items():
                target = posixpath.join(remote, object_of(name, meta))
                self.fs.put_file(os.path.join(local_dir, name), target)
                if local:
                    _sync(self.fs._strip_protocol(target))
            listed = _sizes(self.fs, remote)
            try:
                _check_sizes(manifest, listed)
            except CorruptCheckpoint as exc:  # a storage fault: a failed upload
                raise OSError(errno.EIO, f"{remote}: uploaded, but {exc}") from None
            writer, body = Writer.of(manifest), json.dumps(manifest, indent=1).encode()
            self._refuse_if_newer(step, writer, listed)
            self.fence()
            published = posixpath.join(remote, writer.manifest)
            self.fs.pipe_file(published, body, mode="create")
        if local:
            for path in (published, remote, self.root):
                _sync(self.fs._strip_protocol(path))
        # One listing confirms it: there at its size (else a storage fault: a failed upload),
        # and no newer writer's beside it (readers take the newest writer's manifest).
        listed = _sizes(self.fs, remote)
        if listed.get(writer.manifest) != len(body):
            raise OSError(errno.EIO, f"the manifest of {remote} is not there at its size")
        self._refuse_if_newer(step, writer, listed)
        self._confirmed = step
        return remote

    def _refuse_if_newer(self, step: int, writer: Writer, listed: dict[str, int]) -> None:
        """:class:`StepTaken` when ``step``'s directory (``listed``) has a newer writer's
        manifest: this commit would name a checkpoint nobody restores."""
        found = _MANIFEST_FILE.match(manifest_of(listed) or "")
        if not found or found.group(1) is None:
            return
        other = Writer(int(found.group(1)), int(found.group(2)), found.group(3))
        if other.key > writer.key:
            raise StepTaken(
                f"step {step} of {self.path_for(step)} was committed by a newer writer (lease "
                f"generation {other.generation}, attempt {other.attempt}); this one "
                f"(generation {writer.generation}, attempt {writer.attempt}) stopped"
            )

    # -- read -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of all checkpoint directories, committed or not, newest first."""
        try:
            # refresh: s3fs caches listings, and another process (the previous attempt, the
            # driver) may have written or pruned checkpoints since this one last looked.
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        found = [_STEP_DIR.match(posixpath.basename(str(e).rstrip("/"))) for e in entries]
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def committed_steps(self) -> list[int]:
        """Steps whose upload completed (they have a manifest), newest first; not verified."""
        return [s for s in self.steps() if manifest_of(_sizes(self.fs, self.path_for(s)))]

    @staticmethod
    def step_of(path: str) -> int | None:
        found = _STEP_DIR.match(posixpath.basename(path.rstrip("/")))
        return int(found.group(1)) if found else None

    def read_manifest(self, step: int, listed: dict[str, int] | None = None) -> dict[str, Any]:
        """The manifest of ``step``'s checkpoint (``listed``: its directory's listing, if the
        caller has one), checked for shape; raises :class:`CorruptCheckpoint`."""
        listed = _sizes(self.fs, self.path_for(step)) if listed is None else listed
        name = manifest_of(listed)
        if name is None:
            raise UncommittedCheckpoint("no manifest: the upload never completed")
        try:
            raw = self.fs.cat_file(posixpath.join(self.path_for(step), name))
        except FileNotFoundError:
            raise UncommittedCheckpoint("no manifest: the upload never completed") from None
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpoint(f"unreadable manifest ({exc})") from None
        _check_manifest(manifest, step)
        if name != MANIFEST and Writer.of(manifest).manifest != name:
            raise CorruptCheckpoint(f"{name} names another writer")
        return manifest

    def read_file(self, step: int, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        """The stored bytes of file ``name`` of the checkpoint of ``step`` (not verified)."""
        manifest = manifest or self.read_manifest(step)
        meta = manifest["files"].get(name)
        if meta is None:
            raise CorruptCheckpoint(f"the manifest names no {name}")
        return self.fs.cat_file(posixpath.join(self.path_for(step), object_of(name, meta)))

    def verifies(self, step: int) -> bool:
        """Does the checkpoint of ``step`` have a manifest whose files are all there, at their
        sizes (one listing)? Said when not. Storage errors propagate."""
        if step == self._confirmed:  # its files and manifest were listed moments ago
            return True
        try:
            listed = _sizes(self.fs, self.path_for(step))
            _check_sizes(self.read_manifest(step, listed), listed)
        except UncommittedCheckpoint:  # an upload not done (or in flight): no checkpoint yet
            return False
        except CorruptCheckpoint as exc:
            logger.warning("checkpoint %s does not verify: %s", self.path_for(step), exc)
            return False
        return True

    def newest_verified(self) -> list[int]:
        """[the newest committed step that :meth:`verifies`], or [] (what a memory snapshot
        must be newer than: a damaged newest checkpoint is no reason to pass one over)."""
        return next(([s] for s in self.committed_steps() if self.verifies(s)), [])

    def download(self, step: int, local_dir: str) -> dict[str, Any]:
        """Download and verify the checkpoint of ``step`` into ``local_dir`` (each file under
        its own name)."""
        manifest = self.read_manifest(step)
        os.makedirs(local_dir, exist_ok=True)
        remote = self.path_for(step)
        for name, meta in manifest["files"].items():
            local = os.path.join(local_dir, name)
            try:
                self.fs.get_file(posixpath.join(remote, object_of(name, meta)), local)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{name} is missing") from None
            size = os.path.getsize(local)
            if size != meta["size"]:
                raise CorruptCheckpoint(f"{name} has {size} bytes, manifest says {meta['size']}")
            if file_digest(local) != meta["sha256"]:
                raise CorruptCheckpoint(f"{name} does not match its checksum")
        return manifest

    def restore_latest(
        self, local_root: str, skipped: list[dict[str, Any]] | None = None
    ) -> RestoreResult | None:
        """The newest valid checkpoint, downloaded under ``local_root``; None if there is none.
        Invalid newer ones are reported in the result's ``skipped`` (and appended to
        ``skipped`` if given, also when there is no valid one): step, path, reason, and
        whether it had been committed. Storage errors that outlast the retry policy propagate:
        an unreachable store must not pass for a corrupt checkpoint (that would restart
        training from an older one)."""
        skipped = [] if skipped is None else skipped
        for step in self.steps():
            local_dir = os.path.join(local_root, self.dir_name(step))
            try:
                self.download(step, local_dir)
            except CorruptCheckpoint as exc:
                logger.warning(
                    "checkpoint %s is not usable (%s); trying an older one",
                    self.path_for(step),
                    exc,
                )
                skipped.append(
                    {
                        "step": step,
                        "path": self.path_for(step),
                        "reason": str(exc),
                        "committed": not isinstance(exc, UncommittedCheckpoint),
                    }
                )
                shutil.rmtree(local_dir, ignore_errors=True)
                continue
            return RestoreResult(
                step=step, path=self.path_for(step), local_dir=local_dir, skipped=skipped
            )
        return None

    # -- lifecycle: ftjob is the one owner of the run's checkpoint directories ----------------

    @property
    def quarantine_root(self) -> str:
        return posixpath.join(posixpath.dirname(self.root), QUARANTINE_DIR)

    def quarantine(self, step: int, reason: str) -> str:
        """Move the directory of ``step`` aside, with a note of why: a checkpoint that does not
        verify is evidence, never deleted. Fenced. Returns where it went."""
        self.fence()
        destination = posixpath.join(
            self.quarantine_root,
            f"{self.dir_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}",
        )
        move_tree(self.fs, self.path_for(step), destination)
        note = {"step": step, "reason": reason, "time": time.time(), "from": self.path_for(step)}
        self.fs.pipe_file(posixpath.join(destination, QUARANTINE_NOTE), json.dumps(note).encode())
        return destination

    def set_aside(self, unusable: list[dict[str, Any]]) -> None:
        """What a restore could not use (:meth:`restore_latest`'s ``skipped``), quarantined;
        each record gains ``quarantined_to``, or ``left`` (why it stayed). A directory without
        a manifest whose newest object is younger than ``settle_s`` may still be written by an
        upload in flight: it is left where it is. A quarantine that fails (a full disk, a
        store that cannot say when a file was written) is said, and the restore goes on.
        Raises LeaseLost when the run is not this driver's."""
        if unusable:
            self.fence()
        for bad in unusable:
            try:
                age = None if bad["committed"] else written_ago(self.fs, bad["path"], self.root)
                if age is None or age >= self.settle_s:
                    bad["quarantined_to"] = self.quarantine(bad["step"], bad["reason"])
                    continue
                bad["left"] = (
                    f"its newest file is {max(age, 0):.0f} s old, under {self.settle_s:g} s "
                    "(checkpoint.lease_timeout): an upload may still be writing it"
                )
            except LeaseLost:
                raise
            except Exception as exc:
                if not is_storage_error(exc) and not isinstance(exc, NotImplementedError):
                    raise
                bad["left"] = f"setting it aside failed ({type(exc).__name__}: {exc})"
            logger.warning("left %s in place: %s", bad["path"], bad["left"])

    def prune(self, keep: int) -> list[int]:
        """Delete committed checkpoints older than the newest ``keep`` that verify (Ray Train's
        own retention is off: one owner): a newest checkpoint that does not verify never costs
        an older one that does, and when fewer than ``keep`` verify nothing is deleted.
        Directories without a manifest are left. Fenced before each delete: a driver that lost
        the run deletes nothing."""
        verified, removed = 0, []
        for step in self.steps():
            if verified < keep:
                verified += self.verifies(step)
            elif manifest_of(_sizes(self.fs, self.path_for(step))):
                removed.append(step)
        for step in removed:
            self.fence()
            remove_tree(self.fs, self.path_for(step))
        return removed
