"""resume=true and resume=auto before Ray starts: which committed checkpoint a run continues from
-- the one the workers restore -- while another writer may commit and prune, and when a newer
ftjob wrote it (no Ray: checkpoints committed by hand)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from ftjob.config import RESUME_AUTO, JobConfig, TrainerConfig, to_plain
from ftjob.driver.resume import ResumeError, Resumption, check_run_name, latest_config
from ftjob.storage.checkpoint import CheckpointStore
from tests.support.storage import RecordingFileSystem

SAVED = JobConfig(
    model={"_target_": "ftjob.models.SmallCNN"},
    dataset={"_target_": "ftjob.datasets.DigitsDataset"},
    trainer=TrainerConfig(),
    name="r",
    resume=RESUME_AUTO,
)


class Generation:
    """A fence that passes, of lease generation ``generation``."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def __call__(self) -> None:
        return None


def commit(store: CheckpointStore, tmp_path: Path, step: int, tag: str) -> None:
    local = tmp_path / f"local-{tag}-{step}"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({**to_plain(SAVED), "tag": tag}))
    (local / "state.json").write_text(json.dumps({"step": step}))
    (local / "model.pt").write_bytes(b"weights")
    store.commit(str(local), step)


def test_resume_auto_continues_from_the_checkpoint_that_replaced_one_pruned_while_read(
    tmp_path: Path,
) -> None:
    # The dead driver's workers outlived it: rank 0 commits step 20 and prunes step 15 while
    # the new driver reads step 15's manifest. It used to refuse the run as damaged
    # ("committed, but none reads: steps [20]").
    run = str(tmp_path / "storage" / "r")
    previous = CheckpointStore(LocalFileSystem(), run)
    commit(previous, tmp_path, 15, "old")

    def upload_lands(op: str, path: str) -> None:
        if op == "cat_file" and "/manifest." in path and not landed:
            landed.append(20)
            commit(previous, tmp_path, 20, "old")
            assert previous.prune(1) == [15]

    landed: list[int] = []
    store = CheckpointStore(RecordingFileSystem(LocalFileSystem(), upload_lands), run)
    decided = check_run_name(SAVED, store, "u")
    assert landed and decided == Resumption(
        True, 20, "resume=auto: run 'r' has a committed checkpoint at step 20 in u: continuing it"
    )


def test_a_resume_continues_from_the_live_generations_checkpoint_not_a_later_zombie_step(
    tmp_path: Path,
) -> None:
    run = str(tmp_path / "storage" / "r")
    fs = LocalFileSystem()
    commit(CheckpointStore(fs, run, Generation(1)), tmp_path, 15, "deposed")
    commit(CheckpointStore(fs, run, Generation(2)), tmp_path, 12, "live")
    store = CheckpointStore(fs, run)
    assert check_run_name(replace(SAVED, resume=True), store, "u") == Resumption(True, 12)
    saved = latest_config(store)
    assert saved is not None and saved["tag"] == "live"


def test_a_checkpoint_of_a_newer_format_is_refused_before_ray_starts(tmp_path: Path) -> None:
    store = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "r"))
    commit(store, tmp_path, 10, "newer")
    manifest = store.read_manifest(10)
    manifest["format"] = 3
    store.fs.pipe_file(store.manifest_path(10), json.dumps(manifest).encode())
    for resume in (True, RESUME_AUTO):  # auto never starts the run over on top of it either
        with pytest.raises(ResumeError) as refused:
            check_run_name(replace(SAVED, resume=resume), store, "u")
        assert str(refused.value) == (
            f"checkpoint {store.path_for(10)} is of checkpoint format 3, written by a newer "
            "ftjob; this ftjob reads formats up to 2: continue the run with that newer ftjob "
            "(nothing was loaded, moved or deleted)"
        )
