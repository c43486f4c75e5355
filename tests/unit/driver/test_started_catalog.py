"""The catalog a run started with: a file removed since keeps its row, its place in the data order
and the fingerprint; a file added changes them. Real image files; no Ray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

from ftjob.config import JobError
from ftjob.data.datasets import GONE, TRAIN, ImageFolderDataset
from ftjob.driver.resume import catalog_fingerprint
from ftjob.driver.started_catalog import remember_catalog, started_catalog
from tests.support.images import bad_tree


def catalog_of(root: Path) -> tuple[ImageFolderDataset, pa.Table]:
    ds = ImageFolderDataset(path=str(root), image_size=8, resize_size=8)
    return ds, ds.catalog(TRAIN)


def test_a_removed_file_keeps_its_row_and_the_fingerprint_while_added_files_change_it(
    tmp_path: Path,
):
    data, run_path = tmp_path / "data", str(tmp_path / "run")
    bad = bad_tree(data)
    ds, table = catalog_of(data)
    fs = ds.fs
    remember_catalog(fs, run_path, table)
    before = catalog_fingerprint(table, ds.num_classes)
    bad["empty"].unlink()
    _, now = catalog_of(data)
    assert catalog_fingerprint(now, 2) != before  # listed again, every later id shifts
    assert started_catalog(fs, run_path, now, resume=False) == (now, [])
    kept, stated = started_catalog(fs, run_path, now, resume=True, max_gone=0.05)
    assert catalog_fingerprint(kept, 2) == before
    assert kept.column(GONE).to_pylist() == [i == 23 for i in range(48)]
    assert kept.column("path").to_pylist() == table.column("path").to_pylist()
    assert stated == [
        "train data: 1 file(s) removed since the run started (a/empty.jpg): each keeps its "
        "place in the data order and is skipped, so the order and exact-once hold"
    ]
    # A file added since cannot keep the order: the catalog as listed, for the resume check.
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(data / TRAIN / "b" / "new.png")
    _, grown = catalog_of(data)
    assert started_catalog(fs, run_path, grown, resume=True) == (grown, [])
    # The decode of a gone row reads nothing and skips it, whatever dataset.bad_files says.
    part = kept.slice(20, 4)  # ids 20-23: the last is gone
    rows = {k: np.asarray(part.column(k).to_pylist()) for k in part.column_names}
    images, skipped = ds.decode_batch(rows, TRAIN, epoch=0, seed=0)
    assert skipped.tolist() == [False, False, False, True]
    assert not images[3].any() and all(images[i].any() for i in range(3))


def test_a_removed_file_whose_name_differed_from_the_rest_keeps_the_others_in_place(
    tmp_path: Path,
):
    # x1, x2 and y: without y every remaining path shares "x", a longer common prefix.
    fs, run_path = LocalFileSystem(), str(tmp_path / "run")
    paths = [str(tmp_path / "data" / "train" / "a" / n) for n in ("x1.png", "x2.png", "y.png")]
    table = pa.table({"id": [0, 1, 2], "label": [0, 0, 0], "path": paths})
    remember_catalog(fs, run_path, table)
    now = pa.table({"id": [0, 1], "label": [0, 0], "path": paths[:2]})
    kept, stated = started_catalog(fs, run_path, now, resume=True, max_gone=0.5)
    assert kept.column(GONE).to_pylist() == [False, False, True]
    assert kept.column("path").to_pylist() == paths and "1 file(s) removed" in stated[0]


def test_a_resume_that_finds_most_of_its_train_files_gone_is_refused(tmp_path: Path):
    """A half-synced copy or a wrong mount: removed files keep their places and are skipped
    unread -- not without bound, or the run goes on, and succeeds, on what is left."""
    fs, run_path = LocalFileSystem(), str(tmp_path / "run")
    paths = [str(tmp_path / "data" / "train" / "a" / f"{i:03d}.png") for i in range(200)]
    table = pa.table({"id": list(range(200)), "label": [0] * 200, "path": paths})
    remember_catalog(fs, run_path, table)
    two_gone = table.slice(0, 198)  # 1 % of 200: within the default
    assert "2 file(s) removed" in started_catalog(fs, run_path, two_gone, resume=True)[1][0]
    half = table.slice(0, 100)
    with pytest.raises(JobError) as refused:
        started_catalog(fs, run_path, half, resume=True)
    assert str(refused.value).startswith(
        "dataset.max_bad_fraction=0.01: 100 of the 200 train files the run started with are "
        f"gone from {tmp_path / 'data' / 'train' / 'a'}/ (100.png, 101.png,"
    )
    assert started_catalog(fs, run_path, half, resume=True, max_gone=0.5)[0].num_rows == 200
