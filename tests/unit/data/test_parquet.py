"""ParquetDataset and its writer (no Ray): the catalog from footers and label columns alone (every
read counted through an fsspec filesystem: no image column byte), a decode that reads only the
row groups its rows are in, the label kinds of Ray's benchmark layout and Hugging Face's, the
stated sources a resume diffs, and bad rows (no label, bytes that do not decode) under
``dataset.bad_files``, named by shard and row."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

from ftjob.config import ConfigError
from ftjob.data.datasets import SOURCES, TRAIN, VAL, DataError
from ftjob.data.parquet import GROUP, NO_LABEL, NO_LABEL_REASON, ROW, SHARD, ParquetDataset
from ftjob.data.to_parquet import convert, main
from ftjob.driver.resume import catalog_fingerprint
from tests.support.images import make_image_tree, truncated_png
from tests.support.jobs import compose_job


class Tracked:
    """A file whose reads are logged as (offset, length)."""

    def __init__(self, f: Any, log: list[tuple[int, int]]) -> None:
        self._f, self._log = f, log

    def read(self, n: int = -1) -> bytes:
        at = self._f.tell()
        data = self._f.read(n)
        self._log.append((at, len(data)))
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> Tracked:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class CountingFS(LocalFileSystem):
    """Local files, every byte read through it logged per path."""

    cachable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reads: dict[str, list[tuple[int, int]]] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        return Tracked(f, self.reads.setdefault(self._strip_protocol(path), []))


def image_chunks(path: str, column: int = 0) -> list[tuple[int, int]]:
    """(start, end) of the image column chunk of every row group."""
    meta = pq.read_metadata(path)
    out = []
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(column)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        out.append((start, start + chunk.total_compressed_size))
    return out


def overlaps(reads: list[tuple[int, int]], chunk: tuple[int, int]) -> bool:
    return any(at < chunk[1] and chunk[0] < at + n for at, n in reads)


def png(value: int, size: int = 10) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One image tree (3 classes, 24 + 6 images each) in both layouts, unshuffled."""
    root = tmp_path_factory.mktemp("parquet")
    tree = make_image_tree(root / "tree", size=12)
    out = {"tree": tree}
    for layout in ("benchmark", "huggingface"):
        convert(str(tree), str(root / layout), 20, rows_per_group=8, layout=layout, shuffle=False)
        out[layout] = root / layout
    return out


def test_the_catalog_comes_from_footers_and_labels_and_a_decode_reads_only_its_row_groups(
    shards: dict[str, Path],
):
    ds = ParquetDataset(str(shards["benchmark"]), image_size=8, resize_size=8)
    fs = ds._fs = CountingFS()
    table = ds.catalog(TRAIN)
    assert table.num_rows == 72 and ds.classes == ["class_0", "class_1", "class_2"]
    files = sorted(str(p) for p in (shards["benchmark"] / TRAIN).glob("*.parquet"))
    assert sorted(fs.reads) == files  # every shard's footer and labels were read ...
    for path in files:  # ... and not one byte of an image column chunk
        assert not any(overlaps(fs.reads[path], c) for c in image_chunks(path))
    # The folder's order (unshuffled): ids by class, then name; positions from the footers.
    assert table.column("label").to_pylist() == [c for c in range(3) for _ in range(24)]
    assert table.column(GROUP).to_pylist()[:20] == [0] * 8 + [1] * 8 + [2] * 4
    assert table.column(ROW).to_pylist()[18:22] == [18, 19, 0, 1]
    # A block of two rows in row group 1 of shard 2 reads that group's image chunk only.
    fs.reads.clear()
    picked = table.take(pa.array([48, 55])).to_pydict()
    rows = {k: np.asarray(v, dtype=object if k == SHARD else None) for k, v in picked.items()}
    images, skipped = ds.decode_batch(rows, VAL, 0, 0)
    assert images.shape == (2, 3, 8, 8) and not skipped.any()
    chunks = image_chunks(files[2])
    assert [overlaps(fs.reads[files[2]], c) for c in chunks] == [False, True, False]
    assert sorted(fs.reads) == [files[2]]


def test_both_layouts_give_the_folder_catalog_and_images(shards: dict[str, Path]):
    bench = ParquetDataset(str(shards["benchmark"]), image_size=8, resize_size=8)
    hf = ParquetDataset(str(shards["huggingface"]), image_size=8, resize_size=8)
    assert bench._kind() == "sorted" and hf._kind() == "int"
    assert hf.classes == bench.classes  # the ClassLabel names kept in the schema
    for split in (TRAIN, VAL):
        a, b = bench.catalog(split), hf.catalog(split)
        assert a.column("label").equals(b.column("label"))
        rows = {k: np.asarray(v) for k, v in a.slice(0, 12).to_pydict().items()}
        rows_hf = {k: np.asarray(v) for k, v in b.slice(0, 12).to_pydict().items()}
        assert np.array_equal(
            bench.decode_batch(rows, split, 1, 3)[0], hf.decode_batch(rows_hf, split, 1, 3)[0]
        )


def test_a_resume_diffs_the_shards_one_by_one(shards: dict[str, Path], tmp_path: Path):
    table = ParquetDataset(str(shards["benchmark"])).catalog(TRAIN)
    stated = catalog_fingerprint(table, 3)
    assert stated["train_rows"] == 72 and stated["shards"] == 4 and stated["num_classes"] == 3
    assert stated["shard part-00003.parquet"].startswith("12 rows, ")
    assert SOURCES in table.schema.metadata
    # A copy elsewhere is the same data; a shard rewritten with a row less is not.
    copy = tmp_path / "copy"
    convert(str(shards["tree"]), str(copy), 20, rows_per_group=8, shuffle=False)
    assert catalog_fingerprint(ParquetDataset(str(copy)).catalog(TRAIN), 3) == stated
    last = copy / TRAIN / "part-00003.parquet"
    pq.write_table(pq.read_table(last).slice(1), last, row_group_size=8)
    changed = catalog_fingerprint(ParquetDataset(str(copy)).catalog(TRAIN), 3)
    differ = {k for k in stated if stated[k] != changed[k]}
    assert differ == {"train_rows", "train_sha256", "shard part-00003.parquet"}


def labelled(path: Path, labels: list[Any], images: list[bytes | None] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    images = images if images is not None else [png(40 * (i % 5)) for i in range(len(labels))]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "label": labels}), path)


def test_label_kinds_map_strings_through_a_class_list_and_refuse_unknown_labels(
    tmp_path: Path,
):
    labelled(tmp_path / TRAIN / "a.parquet", ["dog", "cat", "dog", "eel"])
    labelled(tmp_path / VAL / "a.parquet", ["eel", "cat"])
    listed = ParquetDataset(str(tmp_path), label_kind="classes", classes=["dog", "cat", "eel"])
    assert listed.catalog(TRAIN).column("label").to_pylist() == [0, 1, 0, 2]
    assert listed.catalog(VAL).column("label").to_pylist() == [2, 1]
    ranked = ParquetDataset(str(tmp_path))  # auto: sorted, for strings
    assert ranked.catalog(TRAIN).column("label").to_pylist() == [1, 0, 1, 2]
    with pytest.raises(ConfigError, match="has 3 classes") as err:
        ParquetDataset(str(tmp_path), num_classes=4).catalog(TRAIN)
    assert err.value.key == "dataset.num_classes"
    with pytest.raises(ValueError, match="label 'eel', not a class: dataset.classes does not"):
        ParquetDataset(str(tmp_path), label_kind="classes", classes=["dog", "cat"]).catalog(TRAIN)
    with pytest.raises(ConfigError, match="holds string, not class ids"):
        ParquetDataset(str(tmp_path), label_kind="int").catalog(TRAIN)
    with pytest.raises(ConfigError, match="is not a column of shard") as err:
        ParquetDataset(str(tmp_path), image_column="jpg").catalog(TRAIN)
    assert err.value.key == "dataset.image_column"


def test_bad_rows_fail_or_are_skipped_naming_shard_and_row(tmp_path: Path):
    shard = tmp_path / TRAIN / "s.parquet"
    labelled(shard, [0, 1, None, 0, 1], [png(10), truncated_png(), png(20), None, png(30)])
    labelled(tmp_path / VAL / "s.parquet", [0, 1])
    with pytest.raises(ValueError, match=rf"shard {shard} row 2 \(train\): no label"):
        ParquetDataset(str(tmp_path)).catalog(TRAIN)

    skipping = ParquetDataset(
        str(tmp_path), bad_files="skip", max_bad_fraction=1.0, image_size=8, resize_size=8
    )
    table = skipping.catalog(TRAIN)
    assert table.column(NO_LABEL).to_pylist() == [False, False, True, False, False]
    rows = {k: np.asarray(v) for k, v in table.to_pydict().items()}
    _, skipped = skipping.decode_batch(rows, TRAIN, 0, 0)
    assert skipped.tolist() == [False, True, True, True, False]
    reasons = [skipping.bad_file(table.slice(i, 1).to_pylist()[0]) for i in (1, 2, 3)]
    assert [r.path for r in reasons] == [f"{shard} row {i}" for i in (1, 2, 3)]
    assert reasons[0].reason == "OSError: image file is truncated"
    assert reasons[1].reason.startswith("no label") and reasons[2].reason == "no image bytes"

    failing = ParquetDataset(str(tmp_path), image_size=8, resize_size=8)
    keep = {k: v[[0, 1]] for k, v in rows.items() if k != NO_LABEL}
    with pytest.raises(DataError, match=rf"shard {shard} row 1 \(row group 0\) cannot be"):
        failing.decode_batch(keep, TRAIN, 0, 0)
    keep = {k: v[[3]] for k, v in rows.items() if k != NO_LABEL}
    with pytest.raises(DataError, match=rf"shard {shard} row 3 \(row group 0\) has no image"):
        failing.decode_batch(keep, TRAIN, 0, 0)


def test_check_data_decodes_every_row_and_names_the_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from ftjob.cli.check_data import check_data

    shard = tmp_path / TRAIN / "s.parquet"
    labelled(shard, [0, 1, None, 0], [png(10), truncated_png(), png(20), None])
    labelled(tmp_path / VAL / "s.parquet", [0, 1])
    overrides = ["dataset=parquet", f"dataset.path={tmp_path}", "dataset.bad_files=skip"]
    assert check_data(overrides) == 1
    said = capsys.readouterr().out.splitlines()
    bad = [line for line in said if line.startswith("BAD")]
    assert bad == [
        f"BAD    train {shard} row 1: OSError: image file is truncated",
        f"BAD    train {shard} row 2: {NO_LABEL_REASON}",
        f"BAD    train {shard} row 3: no image bytes",
    ]
    # Every bad row is listed, though a run would refuse the row without a label (1 of 4)
    # before it starts; what the budget makes of them is said last.
    assert said[-1].startswith(
        "ftjob.check --data: with dataset.bad_files=skip a run fails: 3 of the 4 train samples"
    )
    assert "dataset.max_bad_fraction=0.01" in said[-1]


def test_the_configs_compose_and_bad_keys_are_refused_naming_them(tmp_path: Path):
    job = compose_job("dataset=imagenet_parquet", f"dataset.path={tmp_path}")
    assert job.dataset["label_kind"] == "sorted" and job.dataset["num_classes"] == 1000
    with pytest.raises(ConfigError) as err:
        compose_job("dataset=parquet", f"dataset.path={tmp_path}", "dataset.label_kind=names")
    assert err.value.key == "dataset.label_kind" and "must be auto, int" in str(err.value)
    for key, value in (("classes", ["a"]), ("image_column", ""), ("label_kind", "classes")):
        with pytest.raises(ConfigError) as err:
            ParquetDataset(str(tmp_path), **{key: value})
        assert err.value.key == f"dataset.{key}"


def test_the_writer_command_says_what_it_wrote_and_refuses_a_tree_without_images(
    shards: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "out"
    assert main([str(shards["tree"]), str(out), "--rows-per-shard", "50"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == f"train: 72 rows in 2 shard(s) under file://{out}/train"
    rows = pq.read_table(out / TRAIN)
    assert sorted(rows.column("label").to_pylist()) == sorted(f"class_{i % 3}" for i in range(72))
    assert main([str(tmp_path / "none"), str(out), "--rows-per-shard", "5"]) == 1
    assert "no images under train/" in capsys.readouterr().err


def test_parquet_takes_the_image_keys_of_an_image_folder_and_its_own(tmp_path: Path):
    """ParquetDataset passes the image keys on to ImageFolderDataset's constructor, which keeps
    and checks them; its signature lists both, as config checks read it -- all but
    follow_links (shards are files, not a tree of links)."""
    import inspect

    from ftjob.data.datasets import ImageFolderDataset

    image = set(inspect.signature(ImageFolderDataset).parameters) - {"follow_links"}
    own = {"image_column", "label_column", "label_kind", "classes", "shuffle_window"}
    assert set(inspect.signature(ParquetDataset).parameters) == image | own
    ds = ParquetDataset(
        str(tmp_path), image_size=8, resize_size=12, bad_files="skip", label_kind="int"
    )
    assert (ds.image_size, ds.resize_size, ds.bad_files, ds.label_kind) == (8, 12, "skip", "int")
    with pytest.raises(TypeError, match="follow_links"):
        ParquetDataset(str(tmp_path), follow_links=True)
    with pytest.raises(ConfigError) as err:  # an image key's rule, before anything is listed
        compose_job("dataset=parquet", f"dataset.path={tmp_path}", "dataset.image_size=0")
    assert err.value.key == "dataset.image_size"
    with pytest.raises(ConfigError) as err:
        compose_job("dataset=parquet", f"dataset.path={tmp_path}", "+dataset.follow_links=true")
    assert err.value.key == "dataset.follow_links"
