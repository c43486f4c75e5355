"""hydra.launcher.resume=true: what an earlier sweep left in a job dir -- kept, continued from its
committed checkpoint, or run again (no Hydra, no Ray: job dirs and checkpoints made by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from ftjob.cli.launcher import previous_run
from ftjob.storage.checkpoint import CheckpointStore
from tests.support.checkpoints import tagged_checkpoint


def committed(job_dir: Path, name: str, step: int) -> None:
    """A checkpoint of run ``name`` under the job's default storage, as a run commits it."""
    store = CheckpointStore(LocalFileSystem(), str(job_dir / "checkpoints" / name))
    store.commit(tagged_checkpoint(str(job_dir.parent / "scratch"), name, step), step)


def test_a_job_killed_before_its_summary_resumes_from_its_committed_checkpoint(
    tmp_path: Path,
) -> None:
    # Its checkpoints are published as manifest.g<gen>a<attempt>-<nonce>.json: the launcher
    # looked for manifest.json and ran the job again from step 0, under a new name.
    killed = tmp_path / "3"
    committed(killed, "exp-7f3a", 40)
    assert previous_run(str(killed)) == ("resume", "exp-7f3a")


def test_a_job_with_no_committed_checkpoint_or_several_runs_starts_again(tmp_path: Path) -> None:
    cut = tmp_path / "0"  # an upload cut short: files, no manifest
    store = CheckpointStore(LocalFileSystem(), str(cut / "checkpoints" / "a"))
    local = tagged_checkpoint(str(tmp_path / "scratch"), "a", 10)
    store.fs.makedirs(store.path_for(10))
    store.fs.put_file(f"{local}/model.pt", f"{store.path_for(10)}/model.g1a0-00aa.pt")
    assert previous_run(str(cut)) == ("fresh", None)
    two = tmp_path / "1"  # which one is the job's is not known
    committed(two, "b", 10)
    committed(two, "c", 10)
    assert previous_run(str(two)) == ("fresh", None)
    odd = tmp_path / "2"  # a folder that is no run name is not followed
    committed(odd, ".hidden", 10)
    assert previous_run(str(odd)) == ("fresh", None)


def test_a_summary_decides_before_the_checkpoints(tmp_path: Path) -> None:
    done = tmp_path / "0"
    committed(done, "a", 10)
    (done / "summary.json").write_text(json.dumps({"status": "succeeded", "name": "a"}))
    assert previous_run(str(done)) == ("succeeded", "a")
