"""A run's durable checkpoints as anyone reads them: listed afresh, in the order of the run's
timeline, read through their manifests.

**The order is (lease generation, step).** A driver that takes the run over (the next lease
generation) continues from a checkpoint its predecessors committed, so everything it commits is
newer than anything of an older generation, whatever the steps: a deposed driver that wakes
and commits a later step never outranks the live one. Within a generation, by step (a previous
attempt's late commit of a later step is the same driver's training).

**Left behind.** A checkpoint of an older generation at or past a step a newer generation
committed is not on the run's timeline: the newer generation continued from an earlier step.
It is a deposed driver's commit that slipped past the fence (or one the newer driver did not
restore); :func:`left_behind` names them, and retention never counts or deletes them.

**A listing is a moment.** Another writer -- a previous attempt's rank 0 finishing its upload,
a deposed driver -- may commit and prune while a reader goes down the list. A checkpoint that
changed while it was read (gone, its manifest gone or replaced, its upload completed) is not
"damaged": :meth:`CheckpointCatalog.newest` lists again and takes the newest from there.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from ftjob.storage.manifest import (
    MANIFEST,
    CorruptCheckpoint,
    UncommittedCheckpoint,
    Writer,
    check_manifest,
    generation_of,
    manifest_of,
    object_of,
)

logger = logging.getLogger("ftjob.storage.checkpoint")

CHECKPOINTS_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d{9})$")
T = TypeVar("T")


def sizes(fs: AbstractFileSystem, directory: str) -> dict[str, int]:
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


@dataclass(frozen=True)
class Listed:
    """A checkpoint directory as one listing saw it: its step, the lease generation that
    wrote it (:func:`~ftjob.storage.manifest.generation_of`) and its manifest (None: not
    committed)."""

    step: int
    generation: int
    manifest: str | None

    @property
    def key(self) -> tuple[int, int]:
        """Its place in the run's timeline: higher is newer."""
        return (self.generation, self.step)

    @property
    def committed(self) -> bool:
        return self.manifest is not None


def left_behind(entries: Iterable[Listed]) -> dict[int, Listed]:
    """Of committed checkpoints, those a newer generation left behind, by step: each with the
    newer generation's checkpoint at or below its step (which shows that generation
    continued from an earlier one)."""
    committed = [e for e in entries if e.committed]
    lowest: dict[int, Listed] = {}  # each generation's committed checkpoint of the lowest step
    for entry in committed:
        if entry.generation not in lowest or entry.step < lowest[entry.generation].step:
            lowest[entry.generation] = entry
    found = {}
    for entry in committed:
        newer = [
            low
            for generation, low in lowest.items()
            if generation > entry.generation and low.step <= entry.step
        ]
        if newer:
            found[entry.step] = min(newer, key=lambda low: low.step)
    return found


class CheckpointCatalog:
    """The checkpoints of the run at ``run_path`` on ``fs``: listed, ordered and read (every
    reader: the workers' restore, the driver's resume checks, the sweep launcher)."""

    def __init__(self, fs: AbstractFileSystem, run_path: str) -> None:
        self.fs = fs
        self.root = posixpath.join(run_path.rstrip("/"), CHECKPOINTS_DIR)

    def dir_name(self, step: int) -> str:
        return f"step_{step:09d}"

    def path_for(self, step: int) -> str:
        return posixpath.join(self.root, self.dir_name(step))

    @staticmethod
    def step_of(path: str) -> int | None:
        found = STEP_DIR.match(posixpath.basename(path.rstrip("/")))
        return int(found.group(1)) if found else None

    def manifest_path(self, step: int) -> str:
        """The manifest that makes ``step``'s directory a checkpoint (the newest writer's);
        where format 1's would be when it has none."""
        name = manifest_of(sizes(self.fs, self.path_for(step)))
        return posixpath.join(self.path_for(step), name or MANIFEST)

    def steps(self) -> list[int]:
        """Steps of all checkpoint directories, committed or not, highest first."""
        try:
            # refresh: s3fs caches listings, and another process (the previous attempt, the
            # driver) may have written or pruned checkpoints since this one last looked.
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        found = [STEP_DIR.match(posixpath.basename(str(e).rstrip("/"))) for e in entries]
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def listing(self) -> list[Listed]:
        """Every checkpoint directory that holds a file, committed or not, newest first in the
        run's order (lease generation, then step), each from a fresh listing of its own."""
        found = []
        for step in self.steps():
            names = list(sizes(self.fs, self.path_for(step)))
            if names:  # gone since, or not written to yet: nothing there
                found.append(Listed(step, generation_of(names), manifest_of(names)))
        return sorted(found, key=lambda e: e.key, reverse=True)

    def committed_steps(self) -> list[int]:
        """Steps of the run's committed checkpoints (a manifest is there), newest first in the
        run's order; not verified. Non-empty: the run has a committed checkpoint -- the one
        answer to that question, wherever it is asked."""
        return [e.step for e in self.listing() if e.committed]

    def read_manifest(self, step: int, listed: dict[str, int] | None = None) -> dict[str, Any]:
        """The manifest of ``step``'s checkpoint (``listed``: its directory's listing, if the
        caller has one), checked for shape; raises :class:`CorruptCheckpoint`, and
        :class:`~ftjob.storage.manifest.NewerFormat` for one this ftjob cannot read."""
        listed = sizes(self.fs, self.path_for(step)) if listed is None else listed
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
        check_manifest(manifest, step, self.path_for(step))
        if name != MANIFEST and Writer.of(manifest).manifest != name:
            raise CorruptCheckpoint(f"{name} names another writer")
        return manifest

    def read_file(self, step: int, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        """The stored bytes of file ``name`` of the checkpoint of ``step`` (not verified)."""
        manifest = manifest or self.read_manifest(step)
        meta = manifest["files"].get(name)
        if meta is None:
            raise CorruptCheckpoint(f"the manifest names no {name}")
        try:
            return self.fs.cat_file(posixpath.join(self.path_for(step), object_of(name, meta)))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{name} is missing") from None

    def newest(
        self,
        accept: Callable[[Listed], T],
        rejected: Callable[[Listed, CorruptCheckpoint], None] | None = None,
        *,
        committed_only: bool = True,
    ) -> tuple[Listed, T] | None:
        """The newest checkpoint (:meth:`listing`'s order) that ``accept`` takes -- it raises
        :class:`CorruptCheckpoint` for one it does not, which goes to ``rejected`` -- and what
        ``accept`` returned; None when it takes none. One that changed while it was read
        (pruned by a newer commit, its upload completed, a newer writer's manifest
        published) is not rejected: the run's checkpoints are listed again and the newest
        taken from there. Storage errors and ``NewerFormat`` propagate."""
        tried: set[tuple[int, str | None]] = set()
        while True:
            for entry in self.listing():
                if (committed_only and not entry.committed) or (
                    entry.step,
                    entry.manifest,
                ) in tried:
                    continue
                tried.add((entry.step, entry.manifest))
                try:
                    return entry, accept(entry)
                except CorruptCheckpoint as exc:
                    if self._moved(entry):
                        logger.info(
                            "checkpoint %s changed while it was read (%s): listing again",
                            self.path_for(entry.step),
                            exc,
                        )
                        break
                    if rejected is not None:
                        rejected(entry, exc)
            else:
                return None

    def _moved(self, entry: Listed) -> bool:
        """Has ``entry``'s directory changed since it was listed: gone, or another manifest
        (or none, or one where there was none) is its checkpoint now?"""
        now = sizes(self.fs, self.path_for(entry.step))
        return not now or manifest_of(now) != entry.manifest
