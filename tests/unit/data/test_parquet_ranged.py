"""The Parquet catalog on an object store (ftjob/data/ranged_reads.py): a shard's footer and label
chunks in few requests -- one for a small shard, a request per label chunk where image chunks
lie between them that are larger than a request is worth, never an image chunk's byte then --
and the same catalog as from local disk, through a counting filesystem and through s3fs on the
loopback S3 server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from ftjob.config import ConfigError
from ftjob.data import ranged_reads
from ftjob.data.datasets import TRAIN, VAL
from ftjob.data.parquet import ParquetDataset
from ftjob.data.ranged_reads import HeldRanges, column_ranges, merge_ranges
from ftjob.data.to_parquet import convert
from tests.support.images import make_image_tree
from tests.unit.data.test_parquet import image_chunks, overlaps


class RequestLog(LocalFileSystem):
    """Local files behind a protocol that is not local (ftjob reads it as an object store),
    every ranged read -- a request on an object store -- logged per path as (start, end)."""

    protocol = ("objectstore",)
    cachable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: dict[str, list[tuple[int, int]]] = {}

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        data = super().cat_file(path, start=start, end=end, **kw)
        begin = start or 0
        self.requests.setdefault(path, []).append((begin, begin + len(data)))
        return data


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes of 30 images in shards of 20 rows, 4 rows a row group."""
    root = tmp_path_factory.mktemp("ranged")
    tree = make_image_tree(root / "tree", size=12)
    convert(str(tree), str(root / "shards"), 20, rows_per_group=4, shuffle=False)
    return root / "shards"


def labels_and_positions(ds: ParquetDataset, split: str) -> dict[str, list[Any]]:
    table = ds.catalog(split)
    return {name: table.column(name).to_pylist() for name in ("label", "group", "row")}


def test_a_small_shard_is_one_request_and_the_catalog_is_the_local_one(shards: Path):
    local = ParquetDataset(str(shards), image_size=8, resize_size=8)
    remote = ParquetDataset(str(shards), image_size=8, resize_size=8)
    fs = remote._fs = RequestLog()
    for split in (TRAIN, VAL):
        assert labels_and_positions(remote, split) == labels_and_positions(local, split)
    files = sorted(str(p) for p in shards.rglob("*.parquet"))
    assert sorted(fs.requests) == files
    for path in files:  # the whole (small) shard, once
        assert fs.requests[path] == [(0, Path(path).stat().st_size)]
    assert remote.classes == local.classes
    wrong = ParquetDataset(str(shards), label_column="class")
    wrong._fs = RequestLog()
    with pytest.raises(ConfigError, match="dataset.label_column"):  # seen in the footer
        wrong.catalog(TRAIN)


def test_a_truncated_shard_on_an_object_store_is_named_as_on_local_disk(
    shards: Path, tmp_path: Path
):
    """A shard of a few bytes (a truncated upload) is refused naming the shard, as on local
    disk, not with the footer parser's own error."""
    broken = tmp_path / "shards"
    for split in (TRAIN, VAL):
        (broken / split).mkdir(parents=True)
        for shard in (shards / split).glob("*.parquet"):
            (broken / split / shard.name).write_bytes(shard.read_bytes())
    truncated = sorted((broken / TRAIN).glob("*.parquet"))[0]
    truncated.write_bytes(b"PAR1")
    for fs in (LocalFileSystem(), RequestLog()):
        ds = ParquetDataset(str(broken))
        ds._fs = fs
        with pytest.raises(ValueError, match=f"{truncated.name} cannot be read as Parquet"):
            ds.catalog(TRAIN)


def test_label_chunks_far_apart_are_a_request_each_and_no_image_byte_is_read(
    shards: Path, monkeypatch: pytest.MonkeyPatch
):
    # Image chunks larger than a request is worth (ImageNet's): nothing is merged, the tail
    # holds the footer alone.
    monkeypatch.setattr(ranged_reads, "HOLE_BYTES", 0)
    monkeypatch.setattr(ranged_reads, "TAIL_BYTES", 8)
    local = ParquetDataset(str(shards))
    remote = ParquetDataset(str(shards))
    fs = remote._fs = RequestLog()
    assert labels_and_positions(remote, TRAIN) == labels_and_positions(local, TRAIN)
    for path in sorted(str(p) for p in (shards / TRAIN).glob("*.parquet")):
        groups = pq.read_metadata(path).num_row_groups
        assert groups > 1 and len(fs.requests[path]) == 2 + groups  # tail, footer, each chunk
        reads = [(start, end - start) for start, end in fs.requests[path]]
        assert not any(overlaps(reads, chunk) for chunk in image_chunks(path))


def test_ranges_merge_across_small_gaps_only_and_a_read_outside_them_is_fetched(shards: Path):
    assert merge_ranges([(50, 60), (0, 10), (12, 20)], hole=5) == [(0, 20), (50, 60)]
    assert merge_ranges([(0, 10), (12, 20)], hole=5, largest=15) == [(0, 10), (12, 20)]
    assert merge_ranges([(0, 10), (12, 20)], hole=0) == [(0, 10), (12, 20)]
    path = str(next((shards / TRAIN).glob("*.parquet")))
    ranges = column_ranges(pq.read_metadata(path), "label")
    assert len(ranges) == pq.read_metadata(path).num_row_groups
    data = Path(path).read_bytes()
    fs = RequestLog()
    held = HeldRanges(fs, path, len(data), [(10, data[10:30])])
    held.seek(12)
    assert held.read(8) == data[12:20] and fs.requests == {}  # served from memory
    held.seek(25)
    assert held.read(10) == data[25:35] and fs.requests == {path: [(25, 35)]}  # one request


@pytest.mark.s3
def test_the_catalog_through_s3fs_on_the_loopback_server(
    shards: Path, s3_endpoint: str, s3_bucket: str
):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.put(str(shards / TRAIN) + "/", f"{s3_bucket}/shards/{TRAIN}/", recursive=True)
    remote = ParquetDataset(
        f"s3://{s3_bucket}/shards", storage_options={"endpoint_url": s3_endpoint}
    )
    local = ParquetDataset(str(shards))
    assert labels_and_positions(remote, TRAIN) == labels_and_positions(local, TRAIN)
    s3fs.S3FileSystem.clear_instance_cache()
