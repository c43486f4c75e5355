"""The durable checkpoint format: who wrote a checkpoint, the names it stores its files under,
and the manifest that makes its directory a checkpoint.

A checkpoint directory ``step_{step:09d}/`` holds its writer's files under object names of that
writer's own (``model.g3a1-5f0c2e9a.pt``: the run lease's generation, the attempt, a random
part) and, published last, its manifest ``manifest.g3a1-5f0c2e9a.json``: each file's size,
SHA-256 and object name, the step, the writer and the format. A directory is *committed* when
a manifest is listed in it; its checkpoint is its newest writer's manifest (format 1's one
``manifest.json``, files under their own names, ranks lowest).

A manifest of a newer format than :data:`FORMAT` was written by a newer ftjob that may store
its files in ways this one cannot read: it is refused (:class:`NewerFormat`) before anything is
loaded, and never taken for damage.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MANIFEST = "manifest.json"  # format 1's one manifest; format 2: manifest.<writer tag>.json
MANIFEST_FILE = re.compile(r"^manifest(?:\.g(\d+)a(-?\d+)-([0-9a-f]+))?\.json$")
# A writer's tag in the name of an object it stored: model.g3a1-5f0c2e9a.pt
WRITER_TAG = re.compile(r"\.g(\d+)a(-?\d+)-[0-9a-f]+(?:\.[^.]*)?$")
FORMAT = 2  # 1: files stored under their own names, no writer; the newest this ftjob reads
_CHUNK = 8 * 1024 * 1024


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class CorruptCheckpoint(Exception):
    """A checkpoint that is incomplete or does not match its manifest."""


class UncommittedCheckpoint(CorruptCheckpoint):
    """A directory without a manifest: an upload that never completed (never a checkpoint)."""


class NewerFormat(Exception):
    """A checkpoint written by a newer ftjob, in a format this one does not read. Not damage:
    it is never quarantined, and nothing older is restored in its place."""


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

    @classmethod
    def named(cls, manifest_name: str) -> Writer | None:
        """The writer a format-2 manifest's file name names; None for any other name."""
        found = MANIFEST_FILE.match(manifest_name)
        if not found or found.group(1) is None:
            return None
        return cls(int(found.group(1)), int(found.group(2)), found.group(3))


def build_manifest(local_dir: str, step: int, writer: Writer | None = None) -> dict[str, Any]:
    writer = writer or Writer(nonce=secrets.token_hex(4))
    files = {}
    for name in sorted(os.listdir(local_dir)):
        full = os.path.join(local_dir, name)
        if MANIFEST_FILE.match(name) or not os.path.isfile(full):
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


def manifest_of(names: Iterable[str]) -> str | None:
    """Of the file names in a checkpoint directory, its manifest: the newest writer's
    (highest lease generation, then attempt; format 1's ``manifest.json`` is the oldest). A
    late manifest of an older writer is never the checkpoint's."""
    ranked = []
    for name in names:
        found = MANIFEST_FILE.match(name)
        if found:
            generation, attempt, nonce = found.groups()
            key = (-1, -1, "") if generation is None else (int(generation), int(attempt), nonce)
            ranked.append((key, name))
    return max(ranked)[1] if ranked else None


def generation_of(names: Iterable[str]) -> int:
    """The lease generation a checkpoint directory's files (``names``) were written by: its
    manifest's writer's; without a manifest, the newest writer's whose objects are there; -1
    for format 1 (and a directory with no writer's file)."""
    names = list(names)
    manifest = manifest_of(names)
    if manifest is not None:
        writer = Writer.named(manifest)
        return -1 if writer is None else writer.generation
    tagged = (WRITER_TAG.search(name) for name in names)
    return max((int(found.group(1)) for found in tagged if found), default=-1)


def _plain(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not MANIFEST_FILE.match(name)
        and "/" not in name
        and "\\" not in name
    )


def check_manifest(manifest: Any, step: int, where: str) -> None:
    """A manifest of a format this ftjob reads (else :class:`NewerFormat`, naming both), that
    names plain files (no paths: they are joined to local directories) with a size, a
    checksum and the plain name it is stored under, for the step of the directory it is in
    (``where``)."""
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint("malformed manifest: no file table")
    version = manifest.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpoint(f"malformed manifest: format {version!r}")
    if version > FORMAT:
        raise NewerFormat(
            f"checkpoint {where} is of checkpoint format {version}, written by a newer ftjob; "
            f"this ftjob reads formats up to {FORMAT}: continue the run with that newer ftjob "
            "(nothing was loaded, moved or deleted)"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint("malformed manifest: no file table")
    if manifest.get("step") != step:
        raise CorruptCheckpoint(f"manifest is for step {manifest.get('step')}, not {step}")
    for name, meta in files.items():
        if not _plain(name) or not isinstance(meta, dict) or not _plain(object_of(name, meta)):
            raise CorruptCheckpoint(f"malformed manifest entry {name!r}")
        if not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
            raise CorruptCheckpoint(f"manifest entry {name!r} lacks a size or a checksum")


def check_sizes(manifest: dict[str, Any], sizes: dict[str, int]) -> None:
    """Every file of ``manifest`` listed with its size (the cheap verification: one listing)."""
    for name, meta in manifest["files"].items():
        stored = object_of(name, meta)
        if stored not in sizes:
            raise CorruptCheckpoint(f"{name} is missing")
        if sizes[stored] != meta["size"]:
            raise CorruptCheckpoint(
                f"{name} has {sizes[stored]} bytes, manifest says {meta['size']}"
            )
