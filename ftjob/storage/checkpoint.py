"""Atomic checkpoints on any fsspec storage: a checkpoint counts only when its manifest exists
and the files it names are confirmed.

A checkpoint is a directory ``{run}/checkpoints/step_{step:09d}/`` holding the files the
training loop wrote plus its manifest -- each file's size and SHA-256 -- published *last*
(the format: :mod:`ftjob.storage.manifest`). Restoring downloads the newest checkpoint in the
run's order -- lease generation, then step (:mod:`ftjob.storage.catalog`) -- and verifies it
against its manifest; an incomplete or corrupt one (missing manifest, missing or truncated
file, checksum mismatch) is skipped, logged, and the next older one is tried. What does not
verify is moved to ``{run}/quarantine/`` with a note, never deleted. One that changed while
it was read (pruned by a newer commit) is not damage: the run's checkpoints are listed again.
One of a newer format stops the restore, untouched.

**A zombie writer cannot touch a live writer's checkpoint.** Every commit uploads its files
under object names of its own -- ``model.g{generation}a{attempt}-{random}.pt``: the run lease's
generation, the attempt, a random part -- so no upload ever replaces an object another writer
wrote, however late it lands. Files become a checkpoint only through the manifest that names
them, and a manifest is published by an exclusive create, or replaces only a manifest of an
*older* writer (lower generation, or the same generation's earlier attempt): a deposed
driver or a previous attempt's rank 0 that wakes up finds the newer writer's manifest and
stops. The run lease's fence runs before the first upload, before every retry of every
request of the commit, and before the manifest. A deposed driver's commit of a *later* step
ranks below every checkpoint of the generation that took the run over.

**Retention and quarantine never remove the newest checkpoint that verifies.** Before its
manifest is published a commit confirms its files by one listing (every object there, with its
size); :meth:`CheckpointStore.prune` keeps every checkpoint down to the ``keep``-th one that
verifies (manifest against one listing of sizes), so a newest checkpoint that is damaged,
truncated or half-written never costs an older good one; a checkpoint a newer generation left
behind is neither counted nor deleted, but quarantined with a note. A directory is deleted
manifest first: from its first delete on it is no checkpoint. Quarantine is fenced, leaves
alone a directory without a manifest whose newest object is younger than ``settle_s`` (an
upload still in flight: the lease timeout), moves by rename where the filesystem has one (no
space needed), and on object stores deletes only the objects it copied. A quarantine that
fails is said, and the restore goes on.

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
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ftjob.storage.catalog import CHECKPOINTS_DIR, CheckpointCatalog, Listed, left_behind, sizes
from ftjob.storage.errors import is_storage_error
from ftjob.storage.lease import LeaseLost
from ftjob.storage.manifest import (
    FORMAT,
    MANIFEST,
    MANIFEST_FILE,
    CorruptCheckpoint,
    NewerFormat,
    UncommittedCheckpoint,
    Writer,
    build_manifest,
    check_sizes,
    file_digest,
    manifest_of,
    object_of,
)
from ftjob.storage.urls import is_object_store

logger = logging.getLogger("ftjob.storage.checkpoint")

__all__ = [
    "CHECKPOINTS_DIR",
    "FORMAT",
    "MANIFEST",
    "QUARANTINE_DIR",
    "QUARANTINE_NOTE",
    "CheckpointStore",
    "CorruptCheckpoint",
    "NewerFormat",
    "RestoreChoice",
    "RestoreResult",
    "StepTaken",
    "UncommittedCheckpoint",
    "Writer",
    "build_manifest",
    "checkpoint_file",
    "file_digest",
    "manifest_of",
    "move_tree",
    "object_of",
    "remove_tree",
    "written_ago",
]

QUARANTINE_DIR = "quarantine"  # beside checkpoints/: directories that did not verify
QUARANTINE_NOTE = "QUARANTINED.json"


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
    files: list[str] = []
    dirs: list[str] = []
    for name, info in found.items():
        if not str(name).startswith(root + "/"):
            continue
        (dirs if info.get("type") == "directory" else files).append(str(name))
    return sorted(files), sorted(dirs)


def _remove_files(fs: AbstractFileSystem, root: str, files: list[str], dirs: list[str]) -> None:
    """Delete exactly ``files`` (from a listing of ``root``), manifests first (from the first
    delete on, a checkpoint directory is no checkpoint: a reader never sees one with a
    manifest and files missing), then -- on filesystems with directories -- those of ``dirs``
    and ``root`` that are empty now, deepest first: a file that arrived since the listing
    stays, and so does its directory."""
    for name in sorted(files, key=lambda n: not MANIFEST_FILE.match(posixpath.basename(n))):
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


class StepTaken(LeaseLost):
    """A newer writer (a later driver, or a later attempt of this one) committed this step:
    this writer is a zombie and stops."""


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


class CheckpointStore(CheckpointCatalog):
    """Writes, lists, verifies, restores, quarantines and prunes the checkpoints of one run on
    ``fs``.

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
        super().__init__(fs, run_path)
        self.fence = fence or (lambda: None)
        self.generation = int(getattr(fence, "generation", 0) or 0)
        self.attempt, self.settle_s = attempt, settle_s
        self._confirmed: int | None = None  # the step this store last committed (listed)
        self._commits = 0
        self.moved_aside: list[dict[str, Any]] = []  # left behind, by the last prune

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
            listed = sizes(self.fs, remote)
            try:
                check_sizes(manifest, listed)
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
        listed = sizes(self.fs, remote)
        if listed.get(writer.manifest) != len(body):
            raise OSError(errno.EIO, f"the manifest of {remote} is not there at its size")
        self._refuse_if_newer(step, writer, listed)
        self._confirmed = step
        return remote

    def _refuse_if_newer(self, step: int, writer: Writer, listed: dict[str, int]) -> None:
        """:class:`StepTaken` when ``step``'s directory (``listed``) has a newer writer's
        manifest: this commit would name a checkpoint nobody restores."""
        other = Writer.named(manifest_of(listed) or "")
        if other is not None and other.key > writer.key:
            raise StepTaken(
                f"step {step} of {self.path_for(step)} was committed by a newer writer (lease "
                f"generation {other.generation}, attempt {other.attempt}); this one "
                f"(generation {writer.generation}, attempt {writer.attempt}) stopped"
            )

    # -- read -----------------------------------------------------------------------------

    def _check(self, step: int) -> None:
        """Raises :class:`CorruptCheckpoint` unless the manifest of ``step`` is there and its
        files are all listed at their sizes (one listing)."""
        if step == self._confirmed:  # its files and manifest were listed moments ago
            return
        listed = sizes(self.fs, self.path_for(step))
        check_sizes(self.read_manifest(step, listed), listed)

    def verifies(self, step: int) -> bool:
        """Does the checkpoint of ``step`` have a manifest whose files are all there, at their
        sizes (one listing)? Said when not. Storage errors propagate."""
        try:
            self._check(step)
        except UncommittedCheckpoint:  # an upload not done (or in flight): no checkpoint yet
            return False
        except (CorruptCheckpoint, NewerFormat) as exc:
            logger.warning("checkpoint %s does not verify: %s", self.path_for(step), exc)
            return False
        return True

    def newest_verified(self) -> list[tuple[int, int]]:
        """[(lease generation, step) of the newest committed checkpoint that verifies], or []:
        what a memory snapshot must be newer than, in the run's order (a damaged newest
        checkpoint is no reason to pass one over). Raises :class:`NewerFormat` when the newest
        is of a format this ftjob does not read."""

        def said(entry: Listed, exc: CorruptCheckpoint) -> None:
            logger.warning("checkpoint %s does not verify: %s", self.path_for(entry.step), exc)

        found = self.newest(lambda entry: self._check(entry.step), said)
        return [found[0].key] if found else []

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
        """The newest valid checkpoint in the run's order, downloaded under ``local_root``;
        None if there is none. Invalid newer ones are reported in the result's ``skipped``
        (and appended to ``skipped`` if given, also when there is no valid one): step, path,
        reason, and whether it had been committed. One pruned while it was read is none of
        them: the run's checkpoints are listed again. Storage errors that outlast the retry
        policy propagate: an unreachable store must not pass for a corrupt checkpoint (that
        would restart training from an older one); so does :class:`NewerFormat`."""
        skipped = [] if skipped is None else skipped

        def download(entry: Listed) -> str:
            local_dir = os.path.join(local_root, self.dir_name(entry.step))
            try:
                self.download(entry.step, local_dir)
            except CorruptCheckpoint:
                shutil.rmtree(local_dir, ignore_errors=True)
                raise
            return local_dir

        def unusable(entry: Listed, exc: CorruptCheckpoint) -> None:
            path = self.path_for(entry.step)
            logger.warning("checkpoint %s is not usable (%s); trying an older one", path, exc)
            committed = not isinstance(exc, UncommittedCheckpoint)
            skipped.append(
                {"step": entry.step, "path": path, "reason": str(exc), "committed": committed}
            )

        found = self.newest(download, unusable, committed_only=False)
        if found is None:
            return None
        entry, local_dir = found
        skipped[:] = [bad for bad in skipped if bad["step"] != entry.step]  # completed since
        return RestoreResult(entry.step, self.path_for(entry.step), local_dir, skipped)

    # -- lifecycle: ftjob is the one owner of the run's checkpoint directories ----------------

    @property
    def quarantine_root(self) -> str:
        return posixpath.join(posixpath.dirname(self.root), QUARANTINE_DIR)

    def quarantine(self, step: int, reason: str, committed: bool = True) -> str:
        """Move the directory of ``step`` aside, with a note of why and whether it had been
        committed (a checkpoint that went bad; else an upload that never completed): what
        does not verify is evidence, never deleted. Fenced. Returns where it went."""
        self.fence()
        destination = posixpath.join(
            self.quarantine_root,
            f"{self.dir_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}",
        )
        move_tree(self.fs, self.path_for(step), destination)
        note = {
            "step": step,
            "reason": reason,
            "committed": committed,
            "time": time.time(),
            "from": self.path_for(step),
        }
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
                    bad["quarantined_to"] = self.quarantine(
                        bad["step"], bad["reason"], bad["committed"]
                    )
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
        """Delete committed checkpoints older, in the run's order, than the newest ``keep``
        that verify (Ray Train's own retention is off: one owner): a newest checkpoint that
        does not verify never costs an older one that does, and when fewer than ``keep``
        verify nothing is deleted. Directories without a manifest are left. A checkpoint a
        newer lease generation left behind is neither counted nor deleted -- nothing shows it
        superseded: it is of another timeline -- but quarantined with a note, and said
        (:attr:`moved_aside`). Fenced before each delete and move: a driver that lost the
        run deletes nothing."""
        self.moved_aside = []
        committed = [e for e in self.listing() if e.committed]
        behind = left_behind(committed)
        verified, removed = 0, []
        for entry in committed:
            if entry.step in behind:
                continue
            if verified < keep:
                verified += self.verifies(entry.step)
            else:
                removed.append(entry.step)
        for step in removed:
            self.fence()
            remove_tree(self.fs, self.path_for(step))
        self.moved_aside = [
            self._left_behind(e, behind[e.step]) for e in committed if e.step in behind
        ]
        return removed

    def _left_behind(self, entry: Listed, newer: Listed) -> dict[str, Any]:
        """Quarantine ``entry``, which ``newer`` (a newer generation's checkpoint at or below
        its step) left behind; the record, as :meth:`set_aside` leaves it."""
        reason = (
            f"left behind: written by lease generation {entry.generation} at step {entry.step}, "
            f"but generation {newer.generation} took the run over and committed step "
            f"{newer.step}: a deposed driver's commit, not on the run's timeline"
        )
        path = self.path_for(entry.step)
        bad = {"step": entry.step, "path": path, "reason": reason, "committed": True}
        self.set_aside([bad])  # said there when it stays
        if "quarantined_to" in bad:
            logger.warning("checkpoint %s was %s; moved to %s", path, reason, bad["quarantined_to"])
        return bad
