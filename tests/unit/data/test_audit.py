"""A run never starts on catalogs it would train on nothing with (ftjob/data/audit.py): a split
of no samples, a training split of one class -- refused by the driver's preparation and by
``python -m ftjob.check --data``, before Ray starts. Real files; no Ray."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ftjob.cli.check_data import check_data
from ftjob.data.datasets import TRAIN, VAL
from ftjob.driver.runner import prepare
from tests.support.images import write_images
from tests.support.jobs import compose_job


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def shards(root: Path, labels: dict[str, list[int]]) -> Path:
    for split, values in labels.items():
        (root / split).mkdir(parents=True)
        image = pa.array([png(i) for i in range(len(values))], pa.binary())
        table = pa.table({"image": image, "label": pa.array(values, pa.int64())})
        pq.write_table(table, root / split / "part-0.parquet")
    return root


def prepared(tmp_path: Path, *overrides: str) -> None:
    job = compose_job(
        "+experiment=digits_ft",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "trainer.num_workers=1",
        "trainer.batch_size=4",
        f"checkpoint.storage_path={tmp_path / 'store'}",
        *overrides,
    )
    prepare(job, str(tmp_path / "run"))


def test_a_tree_of_one_class_folder_is_refused_before_ray_starts(tmp_path: Path):
    write_images(tmp_path / "data")
    for split in (TRAIN, VAL):  # the user pointed at a tree whose images are all of class a
        for image in (tmp_path / "data" / split / "b").iterdir():
            image.rename(tmp_path / "data" / split / "a" / f"b-{image.name}")
        (tmp_path / "data" / split / "b").rmdir()
    with pytest.raises(ValueError) as err:
        prepared(tmp_path, "dataset=imagefolder", f"dataset.path={tmp_path / 'data'}")
    said = str(err.value)
    assert "every labelled training sample is of one class (a)" in said
    assert "a classifier needs at least 2 classes" in said


def test_parquet_labels_of_one_class_are_refused_though_the_classes_are_declared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    data = shards(tmp_path / "data", {TRAIN: [1] * 16, VAL: [0, 1]})
    common = ("dataset=parquet", f"dataset.path={data}", "dataset.num_classes=2")
    with pytest.raises(ValueError, match=r"every labelled training sample is of one class \(1\)"):
        prepared(tmp_path, *common)
    assert check_data(list(common)) == 1
    assert "ERROR ParquetDataset" in capsys.readouterr().out


def test_a_split_whose_shards_hold_no_rows_is_refused_naming_it(tmp_path: Path):
    data = shards(tmp_path / "data", {TRAIN: [0, 1] * 8, VAL: []})
    with pytest.raises(ValueError) as err:
        prepared(tmp_path, "dataset=parquet", f"dataset.path={data}")
    assert f"ParquetDataset({data}): the val split has no samples" in str(err.value)
