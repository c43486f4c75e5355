"""``dataset=parquet`` in whole jobs in this process (tests/support/local_run.py), on shards the
project's writer made from real image files: both layouts (Ray's benchmark, Hugging Face's)
train exactly as the image folder they came from; bad rows are skipped at their place across a
restart and a resume at another world size (exact-once); changed shards are refused on
resume with the diff."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ftjob.data.datasets import TRAIN
from ftjob.data.to_parquet import convert
from ftjob.driver.resume import ResumeError
from tests.support.images import bad_tree, make_image_tree
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally
from tests.support.summaries import exactly_once

BAD_IDS = {23, 47}  # bad_tree's zero-byte JPEG and truncated PNG, unshuffled


def job(dataset: str, data: Path, *overrides: str) -> Any:
    return compose_job(
        "+experiment=digits_ft",
        f"dataset={dataset}",
        f"dataset.path={data}",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "trainer.validate_every_n_steps=0",
        "trainer.audit_samples=true",
        *overrides,
    )


@pytest.mark.worker
def test_both_layouts_train_exactly_as_the_image_folder(tmp_path: Path):
    tree = make_image_tree(tmp_path / "tree", train_per_class=16, val_per_class=4, size=12)
    one = ("trainer.epochs=2", "trainer.num_workers=1", "trainer.batch_size=8")
    runs = {"folder": run_locally(job("imagefolder", tree, *one), tmp_path / "folder")}
    for layout in ("benchmark", "huggingface"):
        shards = tmp_path / layout
        convert(str(tree), str(shards), 20, rows_per_group=4, layout=layout, shuffle=False)
        # The whole split shuffled (no row-group windows): the folder's order, sample for sample.
        flat = job("parquet", shards, *one, "dataset.shuffle_window=0")
        runs[layout] = run_locally(flat, tmp_path / f"run-{layout}")
    got = {}
    for name, run in runs.items():
        s = run.summary
        assert s["status"] == "succeeded", (name, s["error"], run.errors)
        assert all(exactly_once(epoch) and epoch["unique"] == 48 for epoch in s["audit"])
        got[name] = (s["metrics"]["validation/loss"], s["metrics"]["validation/accuracy"])
    # The same images in the same order: the same training, to the last bit of the loss.
    assert got["benchmark"] == got["folder"] == got["huggingface"]
    assert got["folder"][1] > 0.5  # three classes: it learned


@pytest.mark.worker
def test_bad_rows_are_skipped_exactly_once_across_a_restart_and_a_resume_and_changed_shards_are_refused(  # noqa: E501
    tmp_path: Path,
):
    bad_tree(tmp_path / "tree")  # 48 train files, ids 23 and 47 do not decode
    shards = tmp_path / "shards"
    convert(str(tmp_path / "tree"), str(shards), 16, rows_per_group=4, shuffle=False)
    common = ("name=pq", f"checkpoint.storage_path={tmp_path / 'store'}", "trainer.epochs=2")
    common += ("dataset.bad_files=skip", "dataset.max_bad_fraction=0.05")
    common += ("trainer.checkpoint_every_n_steps=4",)
    # Step 5 fails (restored from 4), step 10 fails past the budget (the newest checkpoint is
    # step 8, in epoch 1). One rank: worlds and resizes are the data order's, tested on folders.
    one = ("trainer.batch_size=8", "trainer.num_workers=1")
    first = run_locally(
        job(
            "parquet",
            shards,
            *common,
            *one,
            "chaos.fail_at_steps=[5,10]",
            "failure.max_failures=1",
        ),
        tmp_path / "a",
    )
    s = first.summary
    assert s["status"] == "failed" and "failure.max_failures=1" in s["error"], first.errors
    epoch0 = s["audit"][0]
    assert exactly_once(epoch0) and epoch0["unique"] == 48
    assert (epoch0["skipped"], epoch0["trained"]) == (2, 46)
    listed = {f["id"]: f for f in s["data"]["skipped_files"]}
    assert set(listed) == BAD_IDS
    part = shards / TRAIN / "part-00001.parquet"  # rows 16-31: id 23 is its row 7
    assert listed[23]["path"] == f"{part} row 7"
    assert listed[23]["reason"].startswith("UnidentifiedImageError")
    assert listed[47]["reason"] == "OSError: image file is truncated"

    # Resumed: the rest of epoch 1, once.
    one += ("resume=true",)
    resumed = run_locally(job("parquet", shards, *common, *one), tmp_path / "b")
    s = resumed.summary
    assert s["status"] == "succeeded", (s["error"], resumed.errors)
    [epoch1] = s["audit"]
    assert epoch1["resumed_at"] == 16 and exactly_once(epoch1) and epoch1["unique"] == 32

    # A shard added and one rewritten: refused before anything trains, shard by shard.
    shutil.copy(part, shards / TRAIN / "part-00003.parquet")
    last = shards / TRAIN / "part-00002.parquet"
    last.write_bytes(part.read_bytes())
    more = ("trainer.epochs=3", *one)
    with pytest.raises(ResumeError) as err:
        run_locally(job("parquet", shards, *common, *more), tmp_path / "c")
    said = str(err.value)
    assert "train data shards: 3 -> 4" in said
    assert "train data shard part-00003.parquet: None -> '16 rows, " in said
    assert "train data shard part-00002.parquet: '16 rows, " in said
