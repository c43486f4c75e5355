"""A shard's footer and label column from an object store in few requests.

On an object store a request costs far more than its bytes: tens of milliseconds to the first
byte, against ~1 MB transferred in that time. A shard's label column is one chunk per row group,
each between two image chunks, so reading the chunks one by one (as pyarrow does) costs a
request per row group -- 21,000 for ImageNet's 1.28 M rows in 64-row groups. Here the footer
comes with the shard's last :data:`TAIL_BYTES` in one request (a second only when the footer is
longer; a shard of at most :data:`HOLE_BYTES` comes whole), the label chunks' byte ranges are
planned from it, ranges closer than :data:`HOLE_BYTES` are merged into one request, and all of
a shard's requests go out at once (``fs.cat_ranges``: concurrent on s3fs/gcsfs). The bytes between two merged label chunks are
read and dropped: at most :data:`HOLE_BYTES` a gap, so image chunks of ImageNet's size
(~7 MB for 64 JPEGs) are never read, and tiny ones cost less than the requests they save.
Local files keep the exact reads (:func:`ftjob.data.shards.read_labels`): no latency to save.
"""

from __future__ import annotations

import bisect
import io
import struct
from collections.abc import Callable
from typing import Any

import pyarrow.parquet as pq

TAIL_BYTES = 64 * 1024  # a shard's tail read with its footer (pyarrow's own footer read size)
HOLE_BYTES = 1024 * 1024  # a gap read rather than a request paid: ~ a request's latency of bytes
MAX_RANGE_BYTES = 32 * 1024 * 1024  # merged ranges stay below this (arrow's range size limit)


def footer_from_tail(tail: bytes, size: int) -> int:
    """The footer's length, from a shard's last bytes (``..., length, PAR1``)."""
    if size < 12 or len(tail) < 8:  # PAR1, a footer, its length, PAR1: a truncated upload
        raise ValueError(f"not a Parquet file ({size} bytes)")
    length, magic = struct.unpack("<i4s", tail[-8:])
    if magic != b"PAR1" or not 0 < length <= size - 12:
        raise ValueError("not a Parquet file (no PAR1 footer)")
    return int(length)


def read_tail_footer(fs: Any, path: str, size: int) -> tuple[pq.FileMetaData, int, bytes]:
    """A shard's footer, and the bytes read for it (from offset ``start`` to the end): one
    request when the footer fits in :data:`TAIL_BYTES`, else two. A shard of at most
    :data:`HOLE_BYTES` is read whole: less than a second request costs."""
    start = 0 if size <= HOLE_BYTES else max(0, size - TAIL_BYTES)
    tail = fs.cat_file(path, start=start, end=size)
    length = footer_from_tail(tail, size)
    if length + 8 > len(tail):
        start = size - 8 - length
        tail = fs.cat_file(path, start=start, end=size - len(tail)) + tail
    meta = pq.read_metadata(io.BytesIO(b"PAR1" + tail[-8 - length :]))
    return meta, start, tail


def column_ranges(meta: pq.FileMetaData, column: str) -> list[tuple[int, int]]:
    """(start, end) of ``column``'s chunk in every row group, from the footer."""
    out = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            if chunk.path_in_schema == column:
                start = chunk.data_page_offset
                if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                    start = min(start, chunk.dictionary_page_offset)
                out.append((start, start + chunk.total_compressed_size))
    return out


def merge_ranges(
    ranges: list[tuple[int, int]], hole: int | None = None, largest: int = MAX_RANGE_BYTES
) -> list[tuple[int, int]]:
    """``ranges`` sorted, with those less than ``hole`` (:data:`HOLE_BYTES`) bytes apart
    merged (a merged range stays below ``largest`` bytes)."""
    hole = HOLE_BYTES if hole is None else hole
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] < hole and end - merged[-1][0] <= largest:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class HeldRanges(io.RawIOBase):
    """A shard as the byte ranges read from it: pyarrow reads the label chunks from memory; a
    read outside them (a writer that pads its chunks) is fetched from ``fs``, one request."""

    def __init__(self, fs: Any, path: str, size: int, held: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._fs, self._path, self._size = fs, path, size
        self._held = sorted(held, key=lambda r: r[0])
        self._starts = [start for start, _ in self._held]
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def size(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._at + n)
        k = bisect.bisect_right(self._starts, self._at) - 1
        if k >= 0 and end <= self._held[k][0] + len(self._held[k][1]):
            start, data = self._held[k]
            out = data[self._at - start : end - start]
        else:
            out = self._fs.cat_file(self._path, start=self._at, end=end) if end > self._at else b""
        self._at += len(out)
        return out

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def read_column_ranged(
    fs: Any, path: str, size: int, column: str, check: Callable[[pq.FileMetaData], None]
) -> tuple[pq.FileMetaData, Any]:
    """A shard's footer and ``column`` (a pyarrow Table of it), in few concurrent requests;
    ``check`` sees the footer before the column is read."""
    meta, tail_start, tail = read_tail_footer(fs, path, size)
    check(meta)
    wanted = [
        (start, end)
        for start, end in merge_ranges(column_ranges(meta, column))
        if not (start >= tail_start and end <= size)  # came with the footer
    ]
    held = [(tail_start, tail)]
    if wanted:
        starts, ends = [s for s, _ in wanted], [e for _, e in wanted]
        got = fs.cat_ranges([path] * len(wanted), starts, ends, on_error="raise")
        held.extend(zip(starts, got, strict=True))
    table = pq.ParquetFile(HeldRanges(fs, path, size, held), metadata=meta, pre_buffer=False).read(
        columns=[column]
    )
    return meta, table
