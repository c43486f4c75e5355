"""Atomic checkpoints on any fsspec storage: a checkpoint counts only when its manifest exists.

A checkpoint is a directory ``{run}/checkpoints/step_{step:09d}/`` holding the files the
training loop wrote plus ``manifest.json`` -- each file's size and SHA-256 -- uploaded *last*,
after every file went up. Restoring downloads the newest checkpoint and verifies it against its
manifest; an incomplete or corrupt one (missing manifest, missing or truncated file, checksum
mismatch) is skipped, logged, and the next older one is tried. What does not verify is moved
to ``{run}/quarantine/`` with a note, never deleted; only committed checkpoints past the
retention count are deleted (:meth:`CheckpointStore.prune`).

Nothing here hands fsspec a pattern: its recursive ``rm``/``mv`` glob-expand their path on
object stores and the memory filesystem (``run[1]`` would match ``run1``), so directories are
deleted and moved as the files a listing returned, one by one. A commit is fenced: ``fence``
(the run lease's check) runs before the first file and again before the manifest, so a driver
that lost its run writes no manifest and prunes nothing.
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
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from ftjob.storage.urls import is_object_store

logger = logging.getLogger("ftjob.storage.checkpoint")

MANIFEST = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
QUARANTINE_DIR = "quarantine"  # beside checkpoints/: directories that did not verify
QUARANTINE_NOTE = "QUARANTINED.json"
_STEP_DIR = re.compile(r"^step_(\d{9})$")
_CHUNK = 8 * 1024 * 1024


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(local_dir: str, step: int) -> dict[str, Any]:
    files = {}
    for name in sorted(os.listdir(local_dir)):
        full = os.path.join(local_dir, name)
        if name == MANIFEST or not os.path.isfile(full):
            continue
        files[name] = {"size": os.path.getsize(full), "sha256": file_digest(full)}
    return {"format": 1, "step": step, "created": time.time(), "files": files}


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


def remove_tree(fs: AbstractFileSystem, path: str) -> None:
    """Delete directory ``path``: the files a listing returned, one by one, then (on
    filesystems with directories) the emptied directories, deepest first."""
    root = fs._strip_protocol(path).rstrip("/")
    files, dirs = _listing(fs, root)
    for name in files:
        try:
            fs.rm_file(name)
        except FileNotFoundError:
            pass
    if not is_object_store(fs.protocol):
        for d in sorted([*dirs, root], key=len, reverse=True):
            with contextlib.suppress(FileNotFoundError):
                fs.rmdir(d)


def move_tree(fs: AbstractFileSystem, source: str, destination: str) -> None:
    """Move directory ``source`` to ``destination`` (which must not exist): each listed file
    copied, then the sources deleted -- never a pattern, and nothing deleted before its copy
    exists."""
    root = fs._strip_protocol(source).rstrip("/")
    target = fs._strip_protocol(destination).rstrip("/")
    files, _ = _listing(fs, root)
    if not is_object_store(fs.protocol):
        fs.makedirs(target, exist_ok=True)
    for name in files:
        relative = name[len(root) + 1 :]
        if not is_object_store(fs.protocol) and "/" in relative:
            fs.makedirs(posixpath.dirname(posixpath.join(target, relative)), exist_ok=True)
        fs.cp_file(name, posixpath.join(target, relative))
    remove_tree(fs, root)


class CorruptCheckpoint(Exception):
    """A checkpoint that is incomplete or does not match its manifest."""


class UncommittedCheckpoint(CorruptCheckpoint):
    """A directory without a manifest: an upload that never completed (never a checkpoint)."""


def _check_manifest(manifest: Any, step: int) -> None:
    """A manifest names plain files (no paths: they are joined to local directories) with a
    size and a checksum, for the step of the directory it is in."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CorruptCheckpoint("malformed manifest: no file table")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(f"manifest is for step {manifest.get('step')}, not {step}")
    for name, meta in files.items():
        plain = name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name
        if not plain or not isinstance(meta, dict):
            raise CorruptCheckpoint(f"malformed manifest entry {name!r}")
        if not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
            raise CorruptCheckpoint(f"manifest entry {name!r} lacks a size or a checksum")


@dataclass
class RestoreResult:
    step: int
    path: str
    local_dir: str
    skipped: list[dict[str, Any]] = field(default_factory=list)


class CheckpointStore:
    """Writes, lists, verifies and prunes the checkpoints of one run on ``fs``."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        run_path: str,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.fs = fs
        self.root = posixpath.join(run_path.rstrip("/"), CHECKPOINTS_DIR)
        # Raises (ftjob.storage.lease.LeaseLost) when this driver no longer holds the run.
        self.fence = fence or (lambda: None)

    def dir_name(self, step: int) -> str:
        return f"step_{step:09d}"

    def path_for(self, step: int) -> str:
        return posixpath.join(self.root, self.dir_name(step))

    # -- write ----------------------------------------------------------------------------

    def commit(self, local_dir: str, step: int) -> str:
        """Upload ``local_dir`` as the checkpoint of ``step``: every file, then the manifest,
        which is read back before the checkpoint counts. Raises when an upload fails after the
        retry policy gave up (the checkpoint then has no manifest and never counts), and
        :class:`~ftjob.storage.lease.LeaseLost` when the run is no longer this driver's (checked
        before the first file and before the manifest)."""
        manifest = build_manifest(local_dir, step)
        remote = self.path_for(step)
        local = _is_local(self.fs)
        self.fence()
        if not is_object_store(self.fs.protocol):
            # Not on object stores: there s3fs's makedirs costs requests and would even
            # re-create a bucket deleted under a running job.
            self.fs.makedirs(remote, exist_ok=True)
        for name in manifest["files"]:
            target = posixpath.join(remote, name)
            self.fs.put_file(os.path.join(local_dir, name), target)
            if local:
                _sync(self.fs._strip_protocol(target))
        body = json.dumps(manifest, indent=1).encode()
        self.fence()
        self.fs.pipe_file(self.manifest_path(step), body)
        if local:
            for path in (self.manifest_path(step), remote, self.root):
                _sync(self.fs._strip_protocol(path))
        if self.fs.cat_file(self.manifest_path(step)) != body:  # a storage fault: a failed upload
            raise OSError(errno.EIO, f"the manifest of {remote} read back different bytes")
        return remote

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
        return [s for s in self.steps() if self.fs.exists(self.manifest_path(s))]

    @staticmethod
    def step_of(path: str) -> int | None:
        found = _STEP_DIR.match(posixpath.basename(path.rstrip("/")))
        return int(found.group(1)) if found else None

    def read_manifest(self, step: int) -> dict[str, Any]:
        try:
            raw = self.fs.cat_file(posixpath.join(self.path_for(step), MANIFEST))
        except FileNotFoundError:
            raise UncommittedCheckpoint("no manifest: the upload never completed") from None
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            raise CorruptCheckpoint(f"unreadable manifest ({exc})") from None
        _check_manifest(manifest, step)
        return manifest

    def read_file(self, step: int, name: str) -> bytes:
        return self.fs.cat_file(posixpath.join(self.path_for(step), name))

    def download(self, step: int, local_dir: str) -> dict[str, Any]:
        """Download and verify the checkpoint of ``step`` into ``local_dir``."""
        manifest = self.read_manifest(step)
        os.makedirs(local_dir, exist_ok=True)
        remote = self.path_for(step)
        for name, meta in manifest["files"].items():
            local = os.path.join(local_dir, name)
            try:
                self.fs.get_file(posixpath.join(remote, name), local)
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
        verify is evidence, never deleted. Returns where it went."""
        destination = posixpath.join(
            self.quarantine_root,
            f"{self.dir_name(step)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}",
        )
        move_tree(self.fs, self.path_for(step), destination)
        note = {"step": step, "reason": reason, "time": time.time(), "from": self.path_for(step)}
        self.fs.pipe_file(posixpath.join(destination, QUARANTINE_NOTE), json.dumps(note).encode())
        return destination

    def prune(self, keep: int) -> list[int]:
        """Delete committed checkpoints older than the newest ``keep`` committed ones (Ray
        Train's own retention is off: one owner). Directories without a manifest are left.
        Fenced: a driver that lost the run deletes nothing."""
        removed = self.committed_steps()[keep:]
        if removed:
            self.fence()
        for step in removed:
            remove_tree(self.fs, self.path_for(step))
        return removed

    def manifest_path(self, step: int) -> str:
        return posixpath.join(self.path_for(step), MANIFEST)
