"""Bad data does not strand a run: ``dataset.bad_files=skip`` drops a file that does not decode
from every epoch at its place in the data order (exact-once over the rest, across restarts and
world sizes), and a run resumes after bad files were removed. Whole jobs on real image files
written with PIL, in this process (tests/support/local_run.py); no Ray."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ftjob.config.rules import JobError
from ftjob.data.datasets import GONE_REASON, TRAIN
from ftjob.data.order import epoch_order
from ftjob.driver.runner import prepare
from ftjob.reporting.run_summary import RunSummary
from ftjob.reporting.summary import format_summary
from tests.support.images import bad_tree, write_images
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally
from tests.support.summaries import exactly_once

BAD_IDS = {23, 47}


def job(data: Path, *overrides: str) -> Any:
    return compose_job(
        "+experiment=digits_ft",
        "dataset=imagefolder",
        f"dataset.path={data}",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "trainer.epochs=2",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.validate_every_n_steps=0",
        "trainer.audit_samples=true",
        *overrides,
    )


@pytest.mark.worker
def test_skipped_files_keep_exact_once_across_a_restart_and_a_resume_after_their_removal(
    tmp_path: Path,
):
    data, storage = tmp_path / "data", tmp_path / "store"
    bad = bad_tree(data)
    common = ("name=shared", f"checkpoint.storage_path={storage}")
    # Two ranks (4 + 4 a step): step 5 fails (restored from 4), step 10 fails past the budget
    # (the newest checkpoint is step 8, in epoch 1).
    first = run_locally(
        job(
            data,
            *common,
            "dataset.bad_files=skip",
            "dataset.max_bad_fraction=0.05",
            "trainer.batch_size=4",
            "trainer.num_workers=2",
            "chaos.fail_at_steps=[5,10]",
            "failure.max_failures=1",
        ),
        tmp_path / "a",
    )
    s = first.summary
    assert s["status"] == "failed" and "failure.max_failures=1" in s["error"], first.errors
    epoch0 = s["audit"][0]
    # Epoch 0 across the restart: every sample once at its place; the two bad ones seen and
    # skipped, the other 46 trained.
    assert exactly_once(epoch0) and epoch0["unique"] == 48
    assert (epoch0["skipped"], epoch0["trained"]) == (2, 46)
    listed = {f["path"]: f for f in s["data"]["skipped_files"]}
    assert set(listed) == {str(p) for p in bad.values()} and s["data"]["skipped"] == 2
    assert listed[str(bad["empty"])]["reason"].startswith("UnidentifiedImageError")
    assert listed[str(bad["truncated"])]["reason"] == "OSError: image file is truncated"
    assert {f["id"] for f in listed.values()} == BAD_IDS
    said = [line for line in first.lines if line.startswith("data: skipped train file")]
    assert len(said) == 2  # once each for the run, not once per epoch or attempt
    printed = format_summary(RunSummary.from_json(s))
    assert "  data: 2 bad file(s) skipped (dataset.bad_files=skip" in printed
    assert f"    {bad['truncated']} (OSError: image file is truncated)" in printed

    # The bad files are removed. 2 of 48 gone is past the default dataset.max_bad_fraction
    # (0.01): refused before anything starts, naming the files and the key.
    for path in bad.values():
        path.unlink()
    again = ("resume=true", "trainer.batch_size=8", "trainer.num_workers=1")
    with pytest.raises(JobError, match=r"dataset.max_bad_fraction=0.01: 2 of the 48 train files"):
        prepare(job(data, *common, *again), str(tmp_path / "refused"))
    # Within the run's own bound, it resumes on one worker (8 a step: the same global batch),
    # with the default dataset.bad_files=fail: the removed files keep their places in the
    # data order and are skipped without being read.
    resumed = run_locally(
        job(data, *common, *again, "dataset.max_bad_fraction=0.05"), tmp_path / "b"
    )
    s = resumed.summary
    assert s["status"] == "succeeded", (s["error"], resumed.errors)
    [epoch1] = s["audit"]
    assert epoch1["epoch"] == 1 and epoch1["resumed_at"] == 2 * 8
    assert exactly_once(epoch1) and epoch1["unique"] == 48 - 16
    order = epoch_order(48, 0, 1)[16:]
    met = BAD_IDS & set(order.tolist())
    assert epoch1["skipped"] == len(met) and epoch1["trained"] == 32 - len(met)
    assert {f["id"] for f in s["data"]["skipped_files"]} == met
    assert all(f["reason"] == GONE_REASON for f in s["data"]["skipped_files"])
    stated = [line for line in resumed.prep.notes if "removed since the run started" in line]
    assert len(stated) == 1 and "2 file(s)" in stated[0]
    assert "a/empty.jpg" in stated[0] and "b/trunc.png" in stated[0]
    assert any("dataset.bad_files: 'skip' -> 'fail'" in n for n in resumed.prep.notes)


# -- dataset.max_bad_fraction: a run never succeeds on a split of bad files --------------------


def paths_as_images(root: Path) -> None:
    """Parquet shards whose image column is binary but holds file paths, not images' bytes:
    the footer cannot tell, so every row is a bad one at decode."""
    for split, n in ((TRAIN, 64), ("val", 16)):
        (root / split).mkdir(parents=True)
        paths = pa.array([f"images/{split}/{i}.jpg".encode() for i in range(n)], pa.binary())
        labels = pa.array([i % 4 for i in range(n)], pa.int64())
        pq.write_table(pa.table({"image": paths, "label": labels}), root / split / "part-0.parquet")


@pytest.mark.worker
def test_a_split_of_bad_rows_fails_at_its_first_step_naming_the_count_and_the_key(
    tmp_path: Path,
):
    paths_as_images(tmp_path / "shards")
    run = run_locally(
        compose_job(
            "+experiment=digits_ft",
            "dataset=parquet",
            f"dataset.path={tmp_path / 'shards'}",
            "dataset.bad_files=skip",
            "dataset.image_size=16",
            "dataset.resize_size=16",
            "trainer.num_workers=1",
            "trainer.batch_size=16",
            "trainer.epochs=2",
            "trainer.validate_every_n_steps=0",
        ),
        tmp_path / "run",
    )
    s = run.summary
    # Before: 80 of 80 rows skipped, accuracy 0.0, and the run succeeded.
    assert s["status"] == "failed", s["metrics"]
    assert "16 of the 64 train samples are bad files skipped (e.g. " in s["error"]
    assert "more than dataset.max_bad_fraction=0.01 of the split (0)" in s["error"]
    assert "raise dataset.max_bad_fraction" in s["error"]
    assert s["metrics"]["train/steps_completed"] == 0  # not one step on nothing
    assert s["data"]["skipped"] == 16


@pytest.mark.worker
def test_bad_files_past_the_fraction_fail_a_run_of_two_ranks_and_within_it_train_on(
    tmp_path: Path,
):
    data = tmp_path / "data"
    bad_tree(data)  # 2 of 48 training files do not decode: 4 %
    two = ("dataset.bad_files=skip", "trainer.batch_size=4", "trainer.num_workers=2")
    over = run_locally(job(data, *two, "trainer.epochs=1"), tmp_path / "over")
    s = over.summary
    assert s["status"] == "failed" and "dataset.max_bad_fraction=0.01" in s["error"], over.errors
    assert "of the 48 train samples are bad files skipped" in s["error"]
    assert s["metrics"]["train/steps_completed"] < 6  # stopped at the first bad file, not the end
    within = run_locally(
        job(data, *two, "trainer.epochs=1", "dataset.max_bad_fraction=0.05"), tmp_path / "within"
    )
    assert within.summary["status"] == "succeeded", (within.summary["error"], within.errors)
    assert within.summary["data"]["skipped"] == 2


@pytest.mark.worker
def test_a_validation_split_of_bad_files_fails_the_run_at_its_first_validation(tmp_path: Path):
    data = tmp_path / "data"
    write_images(data)
    for image in (data / "val").rglob("*.png"):
        image.write_bytes(b"not an image")
    run = run_locally(
        job(data, "dataset.bad_files=skip", "trainer.batch_size=8", "trainer.num_workers=1"),
        tmp_path / "run",
    )
    s = run.summary
    assert s["status"] == "failed", s["metrics"]
    assert "of the 8 val samples are bad files skipped" in s["error"]
