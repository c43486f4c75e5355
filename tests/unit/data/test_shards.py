"""What Parquet shards must be before anything trains (ftjob/data/shards.py, through
ParquetDataset's catalog; no Ray): columns of types that can be images and labels, checked from
the footers; label columns of several writers made one type, or refused naming both shards;
numeric labels mapped to the class ids their values say, never through their strings; row
groups too large for a decoder to hold said with their figures."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ftjob.config import ConfigError
from ftjob.data import shards as shards_module
from ftjob.data.datasets import TRAIN, VAL
from ftjob.data.parquet import ParquetDataset


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def write(root: Path, split: str, name: str, labels: pa.Array, image: Any = None, **kw: Any):
    folder = root / split
    folder.mkdir(parents=True, exist_ok=True)
    if image is None:
        image = pa.array([png(10 * i) for i in range(len(labels))], pa.binary())
    pq.write_table(pa.table({"image": image, "label": labels}), folder / name, **kw)
    return folder / name


def dataset(root: Path, **kwargs: Any) -> ParquetDataset:
    return ParquetDataset(str(root), image_size=8, resize_size=8, **kwargs)


def labels(ds: ParquetDataset, split: str = TRAIN) -> list[int]:
    return ds.catalog(split).column("label").to_pylist()


@pytest.mark.parametrize(
    "image, held",
    [
        (pa.array([f"images/{i}.jpg" for i in range(4)]), "string (file paths?"),
        (pa.array([[1, 2]] * 4, pa.list_(pa.uint8())), "list<element: uint8>"),
        (pa.array([{"bytes": "x", "path": "p"}] * 4), "struct<bytes: string, path: string>"),
    ],
)
def test_an_image_column_that_holds_no_encoded_images_is_refused_from_the_footer(
    tmp_path: Path, image: pa.Array, held: str
):
    shard = write(tmp_path, TRAIN, "a.parquet", pa.array([0, 1, 0, 1]), image)
    write(tmp_path, VAL, "v.parquet", pa.array([0, 1]))
    # bad_files=skip would have skipped every row, a run that trains on nothing
    with pytest.raises(ConfigError) as err:
        dataset(tmp_path, bad_files="skip").catalog(TRAIN)
    assert err.value.key == "dataset.image_column" and err.value.value == "image"
    assert f"column of shard {shard} holds {held}" in err.value.rule
    assert "expected binary" in err.value.rule


def test_a_label_column_that_holds_no_labels_is_refused_naming_it(tmp_path: Path):
    shard = write(tmp_path, TRAIN, "a.parquet", pa.array([[0], [1]]))
    write(tmp_path, VAL, "v.parquet", pa.array([0, 1]))
    with pytest.raises(ConfigError) as err:
        dataset(tmp_path).catalog(TRAIN)
    assert err.value.key == "dataset.label_column"
    assert f"column of shard {shard} holds list<element: int64>, not labels" in err.value.rule


def test_integer_label_shards_of_different_widths_make_one_split(tmp_path: Path):
    write(tmp_path, TRAIN, "a.parquet", pa.array([0, 1, 2], pa.int32()))
    write(tmp_path, TRAIN, "b.parquet", pa.array([2, 1, 0], pa.int64()))
    write(tmp_path, TRAIN, "c.parquet", pa.array([1, 1], pa.uint8()))
    write(tmp_path, VAL, "v.parquet", pa.array([0, 2], pa.int16()))
    ds = dataset(tmp_path)
    assert labels(ds) == [0, 1, 2, 2, 1, 0, 1, 1] and labels(ds, VAL) == [0, 2]
    assert ds.num_classes == 3


def test_shards_with_numbers_and_names_as_labels_are_refused_naming_both(tmp_path: Path):
    ints = write(tmp_path, TRAIN, "a.parquet", pa.array([0, 1], pa.int32()))
    names = write(tmp_path, TRAIN, "b.parquet", pa.array(["cat", "dog"]))
    write(tmp_path, VAL, "v.parquet", pa.array([0, 1]))
    with pytest.raises(ValueError) as err:
        dataset(tmp_path).catalog(TRAIN)
    said = str(err.value)
    assert f"holds numbers in shard {ints} (int32) and strings in shard {names} (string)" in said


def test_a_validation_split_whose_labels_are_of_another_kind_is_refused_naming_both(
    tmp_path: Path,
):
    train = write(tmp_path, TRAIN, "a.parquet", pa.array(["0", "1"]))
    val = write(tmp_path, VAL, "v.parquet", pa.array([0, 1]))
    with pytest.raises(ValueError) as err:
        dataset(tmp_path).catalog(VAL)
    said = str(err.value)
    assert f"holds int64 in shard {val} and string in shard {train} of the training split" in said


def test_whole_float_labels_are_the_class_ids_their_values_say(tmp_path: Path):
    values = [float(i % 11) for i in range(22)]
    write(tmp_path, TRAIN, "a.parquet", pa.array(values, pa.float64()))
    write(tmp_path, VAL, "v.parquet", pa.array([2.0, 10.0], pa.float32()))
    ds = dataset(tmp_path)
    # mapped through their strings, 2.0 was class 3 and 10.0 class 2 ("10" < "2")
    assert labels(ds) == [int(v) for v in values] and labels(ds, VAL) == [2, 10]
    assert ds.classes == [str(i) for i in range(11)]


def test_a_float_label_that_is_not_a_whole_number_is_refused_naming_shard_and_row(
    tmp_path: Path,
):
    shard = write(tmp_path, TRAIN, "a.parquet", pa.array([0.0, 1.0, 0.5, 1.0]))
    write(tmp_path, VAL, "v.parquet", pa.array([0.0, 1.0]))
    with pytest.raises(ValueError) as err:
        dataset(tmp_path, label_kind="sorted").catalog(TRAIN)
    said = str(err.value)
    assert f"the label column 'label' of shard {shard} holds double labels and row 2's" in said
    assert "0.5, is not a whole number" in said


def test_a_nan_label_is_no_label(tmp_path: Path):
    shard = write(tmp_path, TRAIN, "a.parquet", pa.array([0.0, float("nan"), 1.0, None]))
    write(tmp_path, VAL, "v.parquet", pa.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=rf"shard {shard} row 1 \(train\): no label"):
        dataset(tmp_path).catalog(TRAIN)


def test_labels_that_are_whole_numbers_written_as_strings_sort_as_numbers(tmp_path: Path):
    values = [str(i % 12) for i in range(24)]
    write(tmp_path, TRAIN, "a.parquet", pa.array(values))
    write(tmp_path, VAL, "v.parquet", pa.array(["10", "2"]))
    ds = dataset(tmp_path)
    assert ds.classes == [str(i) for i in range(12)]
    assert labels(ds) == [int(v) for v in values] and labels(ds, VAL) == [10, 2]
    words = tmp_path / "words"
    write(words, TRAIN, "a.parquet", pa.array(["n02", "n10", "n01"]))
    write(words, VAL, "v.parquet", pa.array(["n01"]))
    assert dataset(words).classes == ["n01", "n02", "n10"]  # names: as strings


def test_row_groups_too_large_for_a_decoder_are_said_with_their_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(shards_module, "LARGE_GROUP_BYTES", 2**20)
    rng = np.random.default_rng(0)
    blobs = pa.array([rng.bytes(64 * 1024) for _ in range(40)], pa.binary())  # 2.5 MiB
    ids = pa.array([i % 2 for i in range(40)])
    write(tmp_path, TRAIN, "small.parquet", ids, blobs, row_group_size=8)
    write(tmp_path, TRAIN, "whole.parquet", ids, blobs)  # one row group
    write(tmp_path, VAL, "v.parquet", pa.array([0, 1]))
    ds = dataset(tmp_path)
    ds.catalog(TRAIN)
    [note] = [n for n in ds.catalog_notes() if "row group" in n]
    assert "1 row group(s) under train/ hold more than 1 MiB of images each, the largest 3 MiB" in (
        note
    )
    assert "(40 rows: shard whole.parquet row group 0)" in note
    assert "row_group_size=64" in note and "python -m ftjob.data.to_parquet" in note
    small = tmp_path / "small"
    write(small, TRAIN, "a.parquet", ids, blobs, row_group_size=8)
    write(small, VAL, "v.parquet", pa.array([0, 1]))
    assert not [n for n in dataset(small).catalog_notes() if "row group" in n]
