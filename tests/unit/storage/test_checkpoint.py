"""Atomic checkpoints: manifest last, verified restore with fallback, pruning of newer
directories, and the background uploader. Local disk and an in-memory object-store stand-in;
no Ray, no sleeping."""

from __future__ import annotations

import errno
import json
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftjob.config import CheckpointConfig
from ftjob.storage.checkpoint import (
    MANIFEST,
    QUARANTINE_NOTE,
    CheckpointStore,
    CorruptCheckpoint,
    RestoreChoice,
    StepTaken,
)
from ftjob.storage.fs import RetryingFileSystem
from ftjob.storage.lease import LeaseLost
from ftjob.worker.checkpointer import choose_checkpoint
from ftjob.worker.scratch import attempt_scratch_dir, run_scratch_dir, scratch_name
from ftjob.worker.uploads import AsyncUploader, UploadOutcome, upload_checkpoint
from tests.support.checkpoints import (
    flip_bytes,
    manifest_in,
    remote,
    tagged_checkpoint,
    zombie_commit,
)
from tests.support.storage import RecordingFileSystem, no_sleep_policy


@pytest.fixture(params=["local", "memory"])
def storage(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[AbstractFileSystem, str]]:
    """(base filesystem, run path): a local directory, or the in-memory filesystem (no
    directories, like an object store)."""
    if request.param == "local":
        yield LocalFileSystem(), str(tmp_path / "storage" / "run-1")
        return
    saved_store, saved_dirs = dict(MemoryFileSystem.store), list(MemoryFileSystem.pseudo_dirs)
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    try:
        yield MemoryFileSystem(), "/bucket/run-1"
    finally:
        MemoryFileSystem.store.clear()
        MemoryFileSystem.store.update(saved_store)
        MemoryFileSystem.pseudo_dirs[:] = saved_dirs


def write_checkpoint(root: Path, step: int) -> str:
    """A local checkpoint directory like the training loop's (model, optimizer, state)."""
    local = root / f"out_{step}"
    local.mkdir(parents=True, exist_ok=True)
    (local / "model.pt").write_bytes(os.urandom(4096) + step.to_bytes(4, "big"))
    (local / "optimizer.pt").write_bytes(os.urandom(1024))
    (local / "state.json").write_text(json.dumps({"step": step}))
    return str(local)


def model_in(store: CheckpointStore, directory: str) -> bool:
    """Is the model file its manifest names in ``directory`` (a quarantined checkpoint)?"""
    manifest = manifest_in(store.fs, directory)
    return store.fs.exists(posixpath.join(directory, manifest["files"]["model.pt"]["object"]))


def committed_store(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path, steps: list[int]
) -> CheckpointStore:
    base, run_path = storage
    store = CheckpointStore(RetryingFileSystem(base, no_sleep_policy()), run_path)
    for step in steps:
        store.commit(write_checkpoint(tmp_path / "local", step), step)
    return store


# -- commit ---------------------------------------------------------------------------------


def test_commit_uploads_every_file_then_the_manifest_last(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    base, run_path = storage
    recorder = RecordingFileSystem(base)
    store = CheckpointStore(RetryingFileSystem(recorder, no_sleep_policy()), run_path)
    path = store.commit(write_checkpoint(tmp_path, 10), 10)
    assert path == store.path_for(10) and path.endswith("checkpoints/step_000000010")
    uploads = [p for op, p in recorder.calls if op in ("put_file", "pipe_file")]
    assert uploads[-1] == remote(store, 10, MANIFEST)
    assert sorted(uploads[:-1]) == [
        remote(store, 10, n) for n in ("model.pt", "optimizer.pt", "state.json")
    ]
    manifest = store.read_manifest(10)
    assert manifest["step"] == 10
    assert manifest["files"]["model.pt"]["size"] == 4100
    assert len(manifest["files"]["model.pt"]["sha256"]) == 64


def test_steps_lists_newest_first_and_ignores_other_entries(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 30, 20])
    store.fs.pipe_file(f"{store.root}/notes.txt", b"not a checkpoint")
    assert store.steps() == [30, 20, 10]


def test_steps_of_a_run_without_checkpoints_is_empty(
    storage: tuple[AbstractFileSystem, str],
) -> None:
    base, run_path = storage
    assert CheckpointStore(RetryingFileSystem(base, no_sleep_policy()), run_path).steps() == []


def test_download_verifies_the_files_against_the_manifest(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10])
    source = Path(tmp_path / "local" / "out_10")
    store.download(10, str(tmp_path / "restored"))
    for name in ("model.pt", "optimizer.pt", "state.json"):
        assert (tmp_path / "restored" / name).read_bytes() == (source / name).read_bytes()


# -- restore and fallback -------------------------------------------------------------------


def test_restore_latest_picks_the_newest_valid_checkpoint(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None
    assert (result.step, result.path, result.skipped) == (20, store.path_for(20), [])
    assert json.loads(Path(result.local_dir, "state.json").read_text()) == {"step": 20}


def _truncate(store: CheckpointStore, step: int) -> None:
    data = store.fs.cat_file(remote(store, step, "model.pt"))
    store.fs.pipe_file(remote(store, step, "model.pt"), data[: len(data) // 2])


def _remove(store: CheckpointStore, step: int) -> None:
    store.fs.rm_file(remote(store, step, "optimizer.pt"))


def _drop_manifest(store: CheckpointStore, step: int) -> None:
    store.fs.rm_file(remote(store, step, MANIFEST))


def _garble_manifest(store: CheckpointStore, step: int) -> None:
    store.fs.pipe_file(remote(store, step, MANIFEST), b'{"format": 1, "files": {"model.pt"')


def _manifest_of_another_step(store: CheckpointStore, step: int) -> None:
    manifest = store.read_manifest(step)
    manifest["step"] = step - 10
    store.fs.pipe_file(remote(store, step, MANIFEST), json.dumps(manifest).encode())


def _manifest_with_a_path(store: CheckpointStore, step: int) -> None:
    manifest = store.read_manifest(step)
    manifest["files"]["../../outside"] = manifest["files"].pop("model.pt")
    store.fs.pipe_file(remote(store, step, MANIFEST), json.dumps(manifest).encode())


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "model.pt has 2050 bytes, manifest says 4100"),
        (_remove, "optimizer.pt is missing"),
        (flip_bytes, "model.pt does not match its checksum"),
        (_drop_manifest, "no manifest"),
        (_garble_manifest, "unreadable manifest"),
        (_manifest_of_another_step, "manifest is for step 10, not 20"),
        (_manifest_with_a_path, "malformed manifest entry '../../outside'"),
    ],
    ids=[
        "truncated",
        "missing-file",
        "checksum",
        "no-manifest",
        "garbled-manifest",
        "wrong-step",
        "path-in-manifest",
    ],
)
def test_restore_falls_back_past_a_damaged_latest_checkpoint(
    storage: tuple[AbstractFileSystem, str],
    tmp_path: Path,
    damage: Callable[[CheckpointStore, int], None],
    reason: str,
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    damage(store, 20)
    restore_root = tmp_path / "restore"
    result = store.restore_latest(str(restore_root))
    assert result is not None and result.step == 10
    assert [s["step"] for s in result.skipped] == [20]
    assert reason in result.skipped[0]["reason"]
    assert result.skipped[0]["path"] == store.path_for(20)
    assert sorted(os.listdir(restore_root)) == ["step_000000010"]  # the bad download is gone
    assert not (tmp_path / "outside").exists()


def test_restore_returns_none_when_no_checkpoint_is_valid(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10])
    _drop_manifest(store, 10)
    with pytest.raises(CorruptCheckpoint, match="no manifest"):
        store.read_manifest(10)  # what `resume=true` checks before it starts
    assert store.restore_latest(str(tmp_path / "restore")) is None


def test_an_upload_killed_midway_is_never_restored(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10])
    base, run_path = storage

    def die_on_optimizer(op: str, path: str) -> BaseException | None:
        return PermissionError("AccessDenied") if "20/optimizer." in path else None

    dying = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(base, die_on_optimizer), no_sleep_policy()), run_path
    )
    with pytest.raises(PermissionError):
        dying.commit(write_checkpoint(tmp_path / "local", 20), 20)
    assert store.steps() == [20, 10]  # the partial directory is there...
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 10  # ...and never used
    assert result.skipped[0]["reason"] == "no manifest: the upload never completed"
    # Set aside (nothing in flight), its note says it was never committed: not a checkpoint
    # that went bad.
    settled = CheckpointStore(store.fs, posixpath.dirname(store.root), settle_s=0.0)
    settled.set_aside(result.skipped)
    note = posixpath.join(result.skipped[0]["quarantined_to"], QUARANTINE_NOTE)
    assert json.loads(settled.fs.cat_file(note))["committed"] is False


def test_restore_does_not_mistake_an_unreachable_store_for_a_corrupt_checkpoint(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    committed_store(storage, tmp_path, [10, 20])
    base, run_path = storage

    def flaky_reads(op: str, path: str) -> BaseException | None:
        if op in ("get_file", "cat_file") and "step_000000020" in path:
            return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return None

    flaky = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(base, flaky_reads), no_sleep_policy(3)), run_path
    )
    # Falling back to step 10 here would silently throw away progress: the error surfaces and
    # Ray Train retries the attempt.
    with pytest.raises(ConnectionResetError, match="gave up after 3 attempts"):
        flaky.restore_latest(str(tmp_path / "restore"))


def test_quarantine_moves_a_damaged_checkpoint_aside_with_a_note(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    _truncate(store, 20)
    skipped: list[dict[str, Any]] = []
    result = store.restore_latest(str(tmp_path / "restore"), skipped)
    assert result is not None and result.step == 10 and skipped == result.skipped
    assert skipped[0]["committed"] is True  # it had a manifest: a checkpoint that went bad
    moved = store.quarantine(20, skipped[0]["reason"])
    assert store.steps() == [10]  # no longer a candidate...
    assert model_in(store, moved)  # ...and not deleted
    note = json.loads(store.fs.cat_file(posixpath.join(moved, QUARANTINE_NOTE)))
    assert note["step"] == 20 and "manifest says" in note["reason"] and note["committed"]
    assert posixpath.dirname(moved) == store.quarantine_root


def test_restore_reports_what_did_not_verify_even_when_nothing_does(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    flip_bytes(store, 20)
    _drop_manifest(store, 10)
    skipped: list[dict[str, Any]] = []
    assert store.restore_latest(str(tmp_path / "restore"), skipped) is None
    assert [(s["step"], s["committed"]) for s in skipped] == [(20, True), (10, False)]


def test_prune_keeps_the_newest_committed_and_leaves_uncommitted_directories(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 20, 30, 40])
    _drop_manifest(store, 20)  # an upload that never completed: not ours to judge here
    assert store.prune(keep=2) == [10]
    assert store.steps() == [40, 30, 20]
    assert store.prune(keep=2) == []


@pytest.mark.parametrize(
    ("name", "neighbour"), [("exp[1]", "exp1"), ("exp?", "expX"), ("exp*", "exp-other")]
)
def test_prune_and_quarantine_touch_only_their_own_run_whatever_its_name(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path, name: str, neighbour: str
) -> None:
    # fsspec's recursive rm and mv expand glob patterns (on the memory filesystem and object
    # stores): pruning run "exp[1]" once deleted the checkpoints of run "exp1" beside it.
    base, run_path = storage
    parent = posixpath.dirname(run_path)
    other = committed_store((base, posixpath.join(parent, neighbour)), tmp_path / "o", [10])
    store = committed_store((base, posixpath.join(parent, name)), tmp_path / "s", [10, 20, 30])
    assert store.prune(keep=1) == [20, 10]
    assert store.steps() == [30]
    _truncate(store, 30)
    moved = store.quarantine(30, "damaged")
    assert store.steps() == [] and model_in(store, moved)
    assert other.steps() == [10]
    assert other.restore_latest(str(tmp_path / "restore")).step == 10  # intact


def test_a_fenced_out_commit_writes_no_manifest_and_prunes_nothing(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    holds = {"value": True}

    class Lost(RuntimeError):
        pass

    def fence() -> None:
        if not holds["value"]:
            raise Lost("run held by another driver")

    fenced = CheckpointStore(store.fs, posixpath.dirname(store.root), fence)
    fenced.commit(write_checkpoint(tmp_path / "a", 30), 30)
    holds["value"] = False
    with pytest.raises(Lost):
        fenced.commit(write_checkpoint(tmp_path / "b", 40), 40)
    with pytest.raises(Lost):
        fenced.prune(keep=1)
    assert fenced.committed_steps() == [30, 20, 10]  # nothing written, nothing deleted


# -- zombie writers: a late writer never costs a live one its checkpoint ----------------------


class StaleFence:
    """The fence of a writer that checked it just before it lost the run: it passes, and
    names the writer's lease generation."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def __call__(self) -> None:
        return None


def test_a_deposed_drivers_late_upload_never_touches_the_new_holders_checkpoint(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    base, run_path = storage
    fs = RetryingFileSystem(base, no_sleep_policy())
    assert isinstance(zombie_commit(fs, run_path, str(tmp_path)), LeaseLost)
    store = CheckpointStore(fs, run_path)
    assert store.committed_steps() == [10]  # B kept one: its own step 10
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 10 and result.skipped == []
    assert Path(result.local_dir, "model.pt").read_text() == "B model.pt step 10\n"
    assert store.prune(1) == []  # and it still counts as the one to keep


def test_a_writer_that_lost_the_run_stops_retrying_its_upload(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # A partitioned writer would otherwise retry each request up to checkpoint.retry.deadline
    # (300 s by default) against a 60 s lease; the fence runs before every retry instead, and
    # its own requests (on this very filesystem) retry as any does.
    base, run_path = storage
    puts: list[str] = []

    def reset_uploads(op: str, path: str) -> BaseException | None:
        if op == "put_file":
            puts.append(path)
            return ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return None

    fs = RetryingFileSystem(RecordingFileSystem(base, reset_uploads), no_sleep_policy(10))

    def fence() -> None:
        fs.exists(posixpath.join(run_path, "lease"))  # the lease is read here too
        if puts:
            raise LeaseLost("run 'r' is now held by another driver")

    with pytest.raises(LeaseLost):
        CheckpointStore(fs, run_path, fence).commit(write_checkpoint(tmp_path, 10), 10)
    assert len(puts) == 1  # not the policy's 10 attempts


def test_a_zombie_past_the_fence_cannot_publish_over_a_newer_writers_manifest(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    base, run_path = storage
    fs = RetryingFileSystem(base, no_sleep_policy())
    older = CheckpointStore(fs, run_path, StaleFence(1), attempt=3)
    newer = CheckpointStore(fs, run_path, StaleFence(2), attempt=0)
    newer.commit(tagged_checkpoint(str(tmp_path), "B", 10), 10)
    with pytest.raises(StepTaken, match="newer writer .lease generation 2, attempt 0"):
        older.commit(tagged_checkpoint(str(tmp_path), "A", 10), 10)
    restored = CheckpointStore(fs, run_path).restore_latest(str(tmp_path / "r1"))
    assert Path(restored.local_dir, "state.json").read_text() == "B state.json step 10\n"
    # The other order: the newer writer replaces what the older one published, and so does a
    # later attempt of one driver.
    older.commit(tagged_checkpoint(str(tmp_path), "A", 20), 20)
    newer.commit(tagged_checkpoint(str(tmp_path), "B", 20), 20)
    later = CheckpointStore(fs, run_path, StaleFence(2), attempt=1)
    later.commit(tagged_checkpoint(str(tmp_path), "C", 20), 20)
    with pytest.raises(StepTaken):
        newer.commit(tagged_checkpoint(str(tmp_path), "B", 20), 20)
    restored = CheckpointStore(fs, run_path).restore_latest(str(tmp_path / "r2"))
    assert Path(restored.local_dir, "model.pt").read_text() == "C model.pt step 20\n"


def test_an_older_writer_that_publishes_after_a_newer_one_names_no_checkpoint(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # The older writer (a previous attempt of this driver: the fence passes for both) found
    # no manifest, then paused; the newer one committed the same step meanwhile; then the
    # older one published. Nothing is replaced: the newest writer's manifest is the step's.
    base, run_path = storage
    fs = RetryingFileSystem(base, no_sleep_policy())
    newer = CheckpointStore(fs, run_path, StaleFence(1), attempt=2)

    def newer_commits_first(op: str, path: str) -> None:
        if op == "pipe_file" and "/manifest." in path and not done:
            done.append(newer.commit(tagged_checkpoint(str(tmp_path), "B", 10), 10))

    done: list[str] = []
    older = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(base, newer_commits_first), no_sleep_policy()),
        run_path,
        StaleFence(1),
        attempt=1,
    )
    with pytest.raises(StepTaken, match="attempt 2"):
        older.commit(tagged_checkpoint(str(tmp_path), "A", 10), 10)
    store = CheckpointStore(fs, run_path)
    assert len([n for n in base.ls(store.path_for(10), detail=False) if "/manifest." in n]) == 2
    restored = store.restore_latest(str(tmp_path / "restore"))
    assert Path(restored.local_dir, "model.pt").read_text() == "B model.pt step 10\n"
    assert store.prune(keep=1) == [] and store.verifies(10)


@pytest.mark.parametrize("damage", [_truncate, _remove, _drop_manifest], ids=lambda f: f.__name__)
def test_prune_never_deletes_the_newest_checkpoint_that_verifies(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path, damage: Callable[..., None]
) -> None:
    store = committed_store(storage, tmp_path, [10, 20])
    damage(store, 20)
    fresh = CheckpointStore(store.fs, posixpath.dirname(store.root))  # knows nothing verified
    assert fresh.prune(keep=1) == []
    assert fresh.restore_latest(str(tmp_path / "restore")).step == 10
    fresh.commit(write_checkpoint(tmp_path / "local", 30), 30)
    assert 10 in fresh.prune(keep=1) and fresh.committed_steps() == [30]


def test_a_commit_counts_only_when_its_files_are_listed_at_their_sizes(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    base, run_path = storage

    def short_upload(op: str, path: str) -> None:  # the store kept half of what it was sent
        if op == "put_file" and "/model." in path:
            store.fs.fs.pipe_file(path, b"half")

    store = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(base), no_sleep_policy()), run_path
    )
    store.commit(write_checkpoint(tmp_path / "a", 10), 10)

    class ShortUploads(RecordingFileSystem):
        def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
            super().put_file(lpath, rpath, **kwargs)
            short_upload("put_file", rpath)

    store.fs = RetryingFileSystem(ShortUploads(base), no_sleep_policy())
    with pytest.raises(OSError, match="uploaded, but model.pt has 4 bytes, manifest says 4100"):
        store.commit(write_checkpoint(tmp_path / "b", 20), 20)
    assert store.committed_steps() == [10]  # no manifest: never a checkpoint
    assert store.prune(keep=1) == []


def test_restore_leaves_an_upload_in_flight_alone_and_its_commit_then_holds(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # A previous attempt's rank 0 (the same driver: the fence passes for both) is uploading
    # step 10 when the next attempt's rank 0 restores. It used to be quarantined under the
    # upload; the manifest then landed in the emptied directory and prune deleted step 5.
    base, run_path = storage
    store = committed_store(storage, tmp_path, [5])

    def restore_before_the_manifest(op: str, path: str) -> None:
        if op == "pipe_file" and "/manifest." in path and not chosen:
            restorer = CheckpointStore(store.fs, run_path, attempt=2)
            chosen.append(choose_checkpoint(restorer, str(tmp_path / "r"), CheckpointConfig()))

    chosen: list[Any] = []
    uploader = CheckpointStore(
        RetryingFileSystem(
            RecordingFileSystem(base, restore_before_the_manifest), no_sleep_policy()
        ),
        run_path,
        attempt=1,
    )
    uploader.commit(write_checkpoint(tmp_path / "local", 10), 10)
    step, skipped = chosen[0].step, chosen[0].set_aside
    assert (
        step == 5
        and skipped[0]["step"] == 10
        and "upload may still be writing" in skipped[0]["left"]
    )
    assert uploader.prune(keep=1) == [5]
    result = store.restore_latest(str(tmp_path / "restore"))
    assert result is not None and result.step == 10 and result.skipped == []


# -- a listing is a moment: another writer commits and prunes while a reader goes down it -------


def _lingering_upload(
    base: AbstractFileSystem, run_path: str, scratch: str, op: str, path_part: str
) -> tuple[CheckpointStore, list[str]]:
    """The previous attempt's rank 0 has committed step 15; a reader's store that, at its
    first ``op`` on a path with ``path_part`` in it, lets that rank 0 (the same driver: the
    fence passes for both) finish its async upload of step 20 and prune to one checkpoint.
    Returns the reader's store and what landed."""
    previous = CheckpointStore(RetryingFileSystem(base, no_sleep_policy()), run_path, attempt=1)
    previous.commit(tagged_checkpoint(scratch, "attempt-1", 15), 15)
    landed: list[str] = []

    def upload_lands(seen: str, path: str) -> None:
        if seen == op and path_part in path and not landed:
            landed.append(previous.commit(tagged_checkpoint(scratch, "attempt-1", 20), 20))
            assert previous.prune(keep=1) == [15]

    reader = RecordingFileSystem(base, upload_lands)
    return CheckpointStore(
        RetryingFileSystem(reader, no_sleep_policy()), run_path, attempt=2
    ), landed


def test_a_checkpoint_pruned_while_a_restore_reads_it_gives_way_to_the_newer_one(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # The restore listed step 15 as the newest; while it downloaded it, step 20 was committed
    # and step 15 pruned. Step 15 was not damaged, and step 20 verifies: the run goes on
    # from step 20 (it used to stop: "no committed checkpoint of this run verifies").
    base, run_path = storage
    restorer, landed = _lingering_upload(base, run_path, str(tmp_path), "get_file", "step_")
    chosen = choose_checkpoint(restorer, str(tmp_path / "restore"), CheckpointConfig())
    assert landed and isinstance(chosen, RestoreChoice), chosen
    assert chosen.step == 20 and chosen.set_aside == ()  # step 15: not "skipped"
    assert Path(chosen.local_dir, "model.pt").read_text() == "attempt-1 model.pt step 20\n"
    assert not base.exists(restorer.quarantine_root)  # nothing quarantined as damaged
    assert sorted(os.listdir(tmp_path / "restore")) == ["step_000000020"]


def test_the_newest_verified_checkpoint_is_looked_for_again_when_one_is_pruned_meanwhile(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # What a memory snapshot must be newer than: step 20, not "none" (a snapshot of step 16
    # would have been restored over step 20).
    base, run_path = storage
    reader, landed = _lingering_upload(base, run_path, str(tmp_path), "cat_file", "/manifest.")
    assert reader.newest_verified() == [(0, 20)] and landed  # no lease: generation 0


def test_a_directory_is_deleted_manifest_first(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # From its first delete on, a directory being pruned is no checkpoint: a reader never
    # sees a manifest whose files are half gone (once read as damage, and quarantined).
    base, run_path = storage
    recorder = RecordingFileSystem(base)
    store = CheckpointStore(RetryingFileSystem(recorder, no_sleep_policy()), run_path)
    local = write_checkpoint(tmp_path / "local", 10)
    Path(local, "config.json").write_text("{}")  # sorts before the manifest's name
    store.commit(local, 10)
    store.commit(write_checkpoint(tmp_path / "local", 20), 20)
    recorder.calls.clear()
    assert store.prune(keep=1) == [10]
    deleted = [path for op, path in recorder.calls if op == "rm_file"]
    assert len(deleted) == 5 and "/manifest." in deleted[0]


# -- the run's order: lease generation, then step ----------------------------------------------


def _zombie_commits_a_later_step(
    base: AbstractFileSystem, run_path: str, scratch: str
) -> tuple[CheckpointStore, CheckpointStore]:
    """Driver A (lease generation 1) commits step 5, passes the fence for step 15 and pauses
    before its manifest; meanwhile its lease lapses, driver B (generation 2) takes the run
    over, restores step 5, commits step 10 and prunes to one checkpoint; then A wakes and
    publishes step 15 (nothing stops it: its fence ran). Returns (A's store, B's store)."""
    from ftjob.storage.lease import RunLease

    fs = RetryingFileSystem(base, no_sleep_policy())
    a = RunLease(fs, run_path, 60.0, owner="host-a:1")
    a.acquire()
    CheckpointStore(fs, run_path, a.fence()).commit(tagged_checkpoint(scratch, "A", 5), 5)
    stores: list[CheckpointStore] = []

    def b_takes_over(op: str, path: str) -> None:
        if op == "pipe_file" and "/manifest." in path and not stores:
            a.release()  # as the store sees it, the same as a lease that expired
            b = RunLease(fs, run_path, 60.0, owner="host-b:2")
            b.acquire()
            stores.append(CheckpointStore(fs, run_path, b.fence()))
            assert stores[0].restore_latest(os.path.join(scratch, "restore-b")).step == 5
            stores[0].commit(tagged_checkpoint(scratch, "B", 10), 10)
            assert stores[0].prune(1) == [5]

    fence = a.fence()
    passed = StaleFence(fence.generation)  # A's fence ran just before B took over
    zombie = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(base, b_takes_over), no_sleep_policy()),
        run_path,
        passed,
    )
    zombie.commit(tagged_checkpoint(scratch, "A", 15), 15)
    return zombie, stores[0]


def test_a_deposed_drivers_later_step_never_becomes_the_runs_newest(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    base, run_path = storage
    _, live = _zombie_commits_a_later_step(base, run_path, str(tmp_path))
    reader = CheckpointStore(RetryingFileSystem(base, no_sleep_policy()), run_path)
    assert reader.committed_steps() == [10, 15]  # generation 2's step 10 first
    assert reader.newest_verified() == [(2, 10)]
    restored = reader.restore_latest(str(tmp_path / "r1"))
    assert restored.step == 10 and restored.skipped == []
    assert Path(restored.local_dir, "model.pt").read_text() == "B model.pt step 10\n"
    # B's next commit and its prune to one checkpoint: B's own step 12 is kept (it used to
    # delete it and keep A's step 15), A's step 15 is quarantined with a note, not deleted.
    live.commit(tagged_checkpoint(str(tmp_path), "B", 12), 12)
    assert live.prune(1) == [10]
    assert reader.committed_steps() == [12]
    [aside] = live.moved_aside
    assert aside["step"] == 15 and "left behind" in aside["reason"]
    assert "generation 2 took the run over and committed step 10" in aside["reason"]
    note = json.loads(base.cat_file(posixpath.join(aside["quarantined_to"], QUARANTINE_NOTE)))
    assert note["step"] == 15 and "lease generation 1" in note["reason"]
    assert model_in(reader, aside["quarantined_to"])
    restored = reader.restore_latest(str(tmp_path / "r2"))
    assert Path(restored.local_dir, "model.pt").read_text() == "B model.pt step 12\n"


def test_a_checkpoint_left_behind_is_not_counted_against_num_to_keep(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # With two to keep, B's step 10 and the step B continued from (A's step 5, committed
    # before the takeover) are the two: A's later step 15 is another timeline's.
    base, run_path = storage
    fs = RetryingFileSystem(base, no_sleep_policy())
    for generation, step in ((1, 5), (1, 15), (2, 10)):
        store = CheckpointStore(fs, run_path, StaleFence(generation))
        store.commit(tagged_checkpoint(str(tmp_path), f"g{generation}", step), step)
    assert store.prune(2) == []
    assert store.committed_steps() == [10, 5]
    assert [a["step"] for a in store.moved_aside] == [15]
    assert store.prune(2) == [] and store.moved_aside == []  # said once


def test_a_previous_attempts_later_step_is_the_same_drivers_and_restored(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    # Within a lease generation the order is by step: a previous attempt's late commit is
    # this driver's own training, never left behind.
    base, run_path = storage
    fs = RetryingFileSystem(base, no_sleep_policy())
    later = CheckpointStore(fs, run_path, StaleFence(3), attempt=2)
    later.commit(tagged_checkpoint(str(tmp_path), "a2", 12), 12)
    CheckpointStore(fs, run_path, StaleFence(3), attempt=1).commit(
        tagged_checkpoint(str(tmp_path), "a1", 15), 15
    )
    assert later.prune(1) == [12] and later.moved_aside == []
    assert later.restore_latest(str(tmp_path / "r")).step == 15


# -- a checkpoint of a newer format -------------------------------------------------------------


def _as_format_3(store: CheckpointStore, step: int) -> None:
    """What a newer ftjob might leave: ``model.pt`` stored gzip-encoded, its manifest (format
    3) saying so -- sizes and checksums all true."""
    import gzip
    import hashlib

    manifest = store.read_manifest(step)
    meta = manifest["files"]["model.pt"]
    where = posixpath.join(store.path_for(step), meta["object"])
    blob = gzip.compress(store.fs.cat_file(where))
    store.fs.pipe_file(where, blob)
    meta.update(size=len(blob), sha256=hashlib.sha256(blob).hexdigest(), encoding="gzip")
    manifest["format"] = 3
    store.fs.pipe_file(store.manifest_path(step), json.dumps(manifest).encode())


def test_a_checkpoint_of_a_newer_format_is_refused_before_anything_is_loaded(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [5, 10])
    _as_format_3(store, 10)
    chosen = choose_checkpoint(store, str(tmp_path / "restore"), CheckpointConfig())
    assert chosen == (
        f"checkpoint {store.path_for(10)} is of checkpoint format 3, written by a newer ftjob; "
        "this ftjob reads formats up to 2: continue the run with that newer ftjob (nothing "
        "was loaded, moved or deleted)"
    )
    assert not (tmp_path / "restore").exists()  # nothing downloaded; step 5 not restored
    assert store.committed_steps() == [10, 5]  # not quarantined: it is not damaged
    assert not store.fs.exists(store.quarantine_root)
    from ftjob.storage.checkpoint import NewerFormat

    fresh = CheckpointStore(store.fs, posixpath.dirname(store.root))  # knows nothing verified
    with pytest.raises(NewerFormat, match="format 3"):
        fresh.newest_verified()  # and no memory snapshot passes for newer than it
    assert fresh.prune(1) == []  # nor does what it cannot read make room for a prune


@pytest.mark.parametrize("full_at", ["cp_file", "pipe_file"])
def test_a_quarantine_that_fails_for_want_of_space_does_not_block_the_restore(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path, full_at: str
) -> None:
    store = committed_store(storage, tmp_path, [5])
    partial = write_checkpoint(tmp_path / "partial", 10)
    store.fs.makedirs(store.path_for(10), exist_ok=True)
    stored = store.writer().object_name("model.pt")  # the upload's first file, then ENOSPC
    store.fs.put_file(f"{partial}/model.pt", f"{store.path_for(10)}/{stored}")

    def disk_full(op: str, path: str) -> BaseException | None:
        return OSError(errno.ENOSPC, "No space left on device") if op == full_at else None

    full = CheckpointStore(
        RetryingFileSystem(RecordingFileSystem(store.fs.fs, disk_full), no_sleep_policy()),
        posixpath.dirname(store.root),
        settle_s=0.0,  # nothing in flight
    )
    choice = choose_checkpoint(full, str(tmp_path / "r"), CheckpointConfig())
    [bad] = choice.set_aside
    assert choice.step == 5 and bad["step"] == 10
    if full_at == "pipe_file":  # not even the clock's probe could be written: left, said
        assert "No space left on device" in bad["left"] and full.steps() == [10, 5]
    elif isinstance(storage[0], LocalFileSystem):  # a rename: no room needed
        assert full.steps() == [5] and model_in_quarantine(full, bad["quarantined_to"])
    else:  # copies could not be made: said, left, and the restore went on
        assert "No space left on device" in bad["left"] and full.steps() == [10, 5]


def model_in_quarantine(store: CheckpointStore, directory: str) -> bool:
    return any("/model." in name for name in store.fs.ls(directory, detail=False))


def test_quarantine_is_fenced(storage: tuple[AbstractFileSystem, str], tmp_path: Path) -> None:
    store = committed_store(storage, tmp_path, [5, 10])
    _truncate(store, 10)

    def lost() -> None:
        raise LeaseLost("run held by another driver")

    deposed = CheckpointStore(store.fs, posixpath.dirname(store.root), lost)
    chosen = choose_checkpoint(deposed, str(tmp_path / "r"), CheckpointConfig())
    assert chosen == "run held by another driver"
    assert store.steps() == [10, 5]  # nothing moved


# -- AsyncUploader and upload outcomes -------------------------------------------------------


class BlockingStore:
    """A checkpoint store whose commit waits until released; records what it committed."""

    def __init__(self, fail_steps: tuple[int, ...] = (), bug_steps: tuple[int, ...] = ()) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.uploaded: list[int] = []
        self.fail_steps, self.bug_steps = fail_steps, bug_steps

    def commit(self, local_dir: str, step: int) -> str:
        self.started.set()
        assert self.release.wait(timeout=30)
        if step in self.fail_steps:
            raise OSError(errno.EBUSY, f"SlowDown [storage put_file s3://b/step_{step}: gave up]")
        if step in self.bug_steps:
            raise KeyError("a bug in checkpoint code")
        self.uploaded.append(step)
        return f"s3://b/step_{step}"

    def upload(self, local_dir: str, step: int) -> UploadOutcome:
        return upload_checkpoint(self, local_dir, step)  # type: ignore[arg-type]


def scratch(tmp_path: Path, step: int) -> str:
    local = tmp_path / f"out_{step}"
    local.mkdir()
    (local / "model.pt").write_bytes(b"weights")
    return str(local)


def test_async_upload_runs_in_the_background_and_close_waits_for_it(tmp_path: Path) -> None:
    store = BlockingStore()
    uploader = AsyncUploader(store.upload)
    local = scratch(tmp_path, 10)
    uploader.submit(local, 10)  # returns while the upload is still blocked
    assert store.started.wait(timeout=30)
    assert uploader.drain() == []  # still running: nothing to report yet
    closed: list[Any] = []
    closer = threading.Thread(target=lambda: closed.extend(uploader.close()))
    closer.start()
    closer.join(timeout=0.2)
    assert closer.is_alive()  # close() is waiting for the pending upload
    store.release.set()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert [(o.step, o.path, o.error) for o in closed] == [(10, "s3://b/step_10", None)]
    assert store.uploaded == [10] and not os.path.exists(local)


def test_async_upload_failures_are_reported_never_lost(tmp_path: Path) -> None:
    store = BlockingStore(fail_steps=(10,))
    store.release.set()
    uploader = AsyncUploader(store.upload)
    first, second = scratch(tmp_path, 10), scratch(tmp_path, 20)
    uploader.submit(first, 10)
    uploader.submit(second, 20)  # waits for step 10 to finish first
    failed = uploader.drain()
    assert [(o.step, o.path) for o in failed] == [(10, None)]
    assert failed[0].error is not None
    assert failed[0].error.startswith("OSError:") and "SlowDown" in failed[0].error
    rest = uploader.close()
    assert [(o.step, o.path, o.error) for o in rest] == [(20, "s3://b/step_20", None)]
    assert not os.path.exists(first) and not os.path.exists(second)  # removed either way
    assert uploader.drain() == []


def test_a_bug_in_an_upload_surfaces_instead_of_counting_as_a_failed_upload(
    tmp_path: Path,
) -> None:
    store = BlockingStore(bug_steps=(10,))
    store.release.set()
    with pytest.raises(KeyError, match="a bug"):
        store.upload(scratch(tmp_path, 10), 10)
    uploader = AsyncUploader(store.upload)
    uploader.submit(scratch(tmp_path, 10), 10)
    with pytest.raises(KeyError, match="a bug"):
        uploader.close()


def test_async_uploader_commits_through_a_checkpoint_store(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    store = committed_store(storage, tmp_path, [])
    uploader = AsyncUploader(lambda d, step: upload_checkpoint(store, d, step))
    for step in (10, 20):
        uploader.submit(write_checkpoint(tmp_path / "local", step), step)
    outcomes = uploader.close()
    assert [(o.step, o.error) for o in outcomes] == [(10, None), (20, None)]
    assert [o.path for o in outcomes] == [store.path_for(10), store.path_for(20)]
    assert store.steps() == [20, 10] and store.read_manifest(20)["step"] == 20


def test_scratch_of_killed_attempts_is_removed_when_a_later_attempt_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    run_a = scratch_name("run-a")
    old = [attempt_scratch_dir(run_a, 0, 0), attempt_scratch_dir(run_a, 0, 1)]
    for path in old:
        Path(path, "model.pt").write_bytes(b"x" * 1024)  # left behind by a SIGKILL
    other_run = attempt_scratch_dir(scratch_name("run-b"), 0, 0)
    current = attempt_scratch_dir(run_a, 1, 1)
    assert not any(os.path.exists(p) for p in old)
    assert os.path.isdir(current) and os.path.isdir(other_run)
    assert os.path.dirname(current) == run_scratch_dir(run_a)


def test_two_drivers_of_one_run_name_get_private_scratch_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two sweep jobs with one `name` used to share <tmp>/ftjob-scratch/<name>: each one's
    # cleanup deleted the other's in-flight checkpoints.
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    first, second = scratch_name("same"), scratch_name("same")
    assert first != second
    mine = attempt_scratch_dir(first, 0, 0)
    Path(mine, "model.pt").write_bytes(b"in flight")
    attempt_scratch_dir(second, 5, 0)  # a later attempt number, but another driver's run
    assert Path(mine, "model.pt").read_bytes() == b"in flight"
    for path in (run_scratch_dir(first), mine):
        assert os.stat(path).st_mode & 0o777 == 0o700  # no other user can read or plant files


def test_scratch_that_is_not_this_users_private_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    name = scratch_name("run")
    os.mkdir(run_scratch_dir(name), 0o777)
    os.chmod(run_scratch_dir(name), 0o777)  # planted open to everyone
    with pytest.raises(PermissionError, match="not a private directory"):
        attempt_scratch_dir(name, 0, 0)
    linked = scratch_name("run")
    os.symlink(tmp_path, run_scratch_dir(linked))
    with pytest.raises(PermissionError, match="not a private directory"):
        attempt_scratch_dir(linked, 0, 0)


def test_a_stopped_runs_summary_names_the_checkpoint_committed_while_it_stopped(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path
) -> None:
    """Workers outlive the driver's last look at the ledger: the summary (and the resume
    command printed from it) must name what a resume will restore."""
    from ftjob.driver.runner import settle_latest
    from ftjob.reporting.run_summary import CheckpointsSection

    store = committed_store(storage, tmp_path, [10, 20, 30, 40])
    _drop_manifest(store, 40)  # cut off by the shutdown: never restored, never named
    lines: list[str] = []
    record = CheckpointsSection(latest=store.path_for(20), committed=2)
    settled = settle_latest(record, store, lines.append)
    assert settled == CheckpointsSection(
        latest=store.path_for(30), committed=3, committed_while_stopping=30
    )
    assert lines == ["checkpoint step 30 was committed while the run stopped"]

    again = settle_latest(settled, store, lines.append)  # named already: nothing to say
    assert len(lines) == 1 and again == settled

    nothing = settle_latest(CheckpointsSection(), store, lines.append)
    assert nothing.latest == store.path_for(30)

    # A resumed run stopped before committing anything new continues from what it restored.
    resumed = settle_latest(CheckpointsSection(), store, lines.append, restored_step=30)
    assert resumed == CheckpointsSection(latest=store.path_for(30), committed=0)
    assert len(lines) == 2


def test_a_failed_runs_summary_survives_storage_that_is_down_at_its_end(
    storage: tuple[AbstractFileSystem, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retries spent re-raise the client's own error (here a ConnectionError, as an outage
    gives): the summary keeps what the record holds and says why it could not look; a bug
    (not a storage error) still surfaces."""
    from ftjob.driver.runner import settle_latest
    from ftjob.reporting.run_summary import CheckpointsSection

    store = committed_store(storage, tmp_path, [10, 20])
    record = CheckpointsSection(latest=store.path_for(20), committed=2)
    lines: list[str] = []

    def outage() -> list[int]:
        raise ConnectionError("Connection refused")

    monkeypatch.setattr(store, "committed_steps", outage)
    assert settle_latest(record, store, lines.append) == record
    assert lines == ["warning: could not list the checkpoints after the stop (Connection refused)"]

    def bug() -> list[int]:
        raise KeyError("step")

    monkeypatch.setattr(store, "committed_steps", bug)
    with pytest.raises(KeyError):
        settle_latest(record, store, lines.append)
