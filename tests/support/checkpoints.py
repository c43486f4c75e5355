"""Checkpoints in storage: where a file of a step is stored, damaging one, reading a manifest,
checkpoint directories whose files say who wrote them, and a deposed driver's late commit."""

from __future__ import annotations

import json
import os
from typing import Any

from fsspec import AbstractFileSystem

from ftjob.storage.checkpoint import (
    MANIFEST,
    CheckpointStore,
    CorruptCheckpoint,
    manifest_of,
    object_of,
)
from tests.support.storage import RecordingFileSystem


def remote(store: CheckpointStore, step: int, name: str) -> str:
    """Where file ``name`` of the checkpoint of ``step`` is stored: under its writer's own
    object name once a manifest names it."""
    if name == MANIFEST:
        return store.manifest_path(step)
    try:
        meta = store.read_manifest(step)["files"].get(name)
    except CorruptCheckpoint:
        meta = None
    return f"{store.path_for(step)}/{object_of(name, meta) if meta else name}"


def flip_bytes(store: CheckpointStore, step: int) -> None:
    data = store.fs.cat_file(remote(store, step, "model.pt"))
    store.fs.pipe_file(remote(store, step, "model.pt"), bytes(b ^ 0xFF for b in data))


def manifest_in(fs: AbstractFileSystem, directory: str) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory`` (a step's, or a quarantined one)."""
    names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)]
    name = manifest_of(names)
    assert name is not None, f"no manifest in {directory}: {names}"
    return json.loads(fs.cat_file(f"{directory.rstrip('/')}/{name}"))


def tagged_checkpoint(root: str, tag: str, step: int) -> str:
    """A local checkpoint directory whose every file says who wrote it, for which step."""
    local = os.path.join(root, f"{tag}_{step}")
    os.makedirs(local, exist_ok=True)
    for name in ("model.pt", "optimizer.pt", "state.json"):
        with open(os.path.join(local, name), "w") as f:
            f.write(f"{tag} {name} step {step}\n")
    return local


def zombie_commit(fs: AbstractFileSystem, run_path: str, scratch: str) -> BaseException:
    """Driver A passes the fence, freezes inside its first upload of step 10 (a SIGSTOP, a VM
    pause, a partition riding out its retries); meanwhile its lease lapses, driver B takes the
    run over, restores step 5, commits its own step 10 and prunes to one checkpoint; then A
    wakes and finishes. Returns what A's commit raised."""
    from ftjob.storage.lease import RunLease

    a = RunLease(fs, run_path, 60.0, owner="host-a:1")
    a.acquire()
    CheckpointStore(fs, run_path, a.fence()).commit(tagged_checkpoint(scratch, "A", 5), 5)

    def b_takes_over() -> None:
        a.release()  # as the store sees it, the same as a lease that expired
        b = RunLease(fs, run_path, 60.0, owner="host-b:2")
        b.acquire()
        store = CheckpointStore(fs, run_path, b.fence(), attempt=0)
        assert store.restore_latest(os.path.join(scratch, "restore-b")).step == 5
        store.commit(tagged_checkpoint(scratch, "B", 10), 10)
        assert store.prune(1) == [5]

    frozen = {"done": False}

    def freeze_once(op: str, path: str) -> None:
        if op == "put_file" and not frozen["done"]:
            frozen["done"] = True
            b_takes_over()

    zombie = CheckpointStore(RecordingFileSystem(fs, freeze_once), run_path, a.fence())
    try:
        zombie.commit(tagged_checkpoint(scratch, "A", 10), 10)
    except Exception as exc:
        return exc
    raise AssertionError("the deposed driver's commit succeeded")
