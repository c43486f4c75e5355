"""Parquet shards as :class:`ftjob.data.parquet.ParquetDataset` reads them: listed by exact name,
their footers and label columns read for the catalog (on local disk without a byte of the image
column; on an object store in few requests), one row group's image column read for a decode, and
labels turned into class ids."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import posixpath
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ftjob.config import ConfigError
from ftjob.data.datasets import _dataset_rule, _reason
from ftjob.data.folders import is_local, names
from ftjob.data.ranged_reads import read_column_ranged

LABEL_KINDS = ("auto", "int", "classes", "sorted")
# dataset.shuffle_window: samples shuffled together, in whole row groups; a decoder holds about
# this many encoded images (ImageNet's JPEGs: ~110 KB each, ~450 MB).
SHUFFLE_WINDOW = 4096
SHARD_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class Shard:
    """One listed shard: its path on the filesystem, its name under the split folder, size."""

    path: str
    name: str
    size: int


@dataclass(frozen=True)
class ShardLabels:
    """What a shard's footer and label column give the catalog."""

    groups: np.ndarray  # rows per row group
    labels: pa.Array  # the label column, as stored (as one type across a split: unify_labels)
    hf_names: list[str] | None  # the label's ClassLabel names (Hugging Face), if kept
    group_bytes: np.ndarray  # the image column's bytes per row group, in memory


def check_parquet_args(kwargs: dict[str, Any]) -> None:
    """The keys ``dataset=parquet`` adds to the image keys: columns and labels."""
    for key in ("image_column", "label_column"):
        value = kwargs.get(key, "x")
        _dataset_rule(
            isinstance(value, str) and bool(value), key, kwargs, "must name a column of the shards"
        )
    kind = kwargs.setdefault("label_kind", "auto")
    _dataset_rule(
        kind in LABEL_KINDS,
        "label_kind",
        kwargs,
        "must be auto, int (class ids), classes (strings mapped through dataset.classes) "
        "or sorted (strings mapped through their sorted set)",
    )
    classes = kwargs.get("classes")
    _dataset_rule(
        classes is None or (len(classes) >= 2 and len(set(classes)) == len(classes)),
        "classes",
        kwargs,
        "must list at least 2 distinct class names (the label strings, in class-id order), "
        "or be null",
    )
    _dataset_rule(
        kind != "classes" or classes is not None,
        "label_kind",
        kwargs,
        "classes needs dataset.classes: the label strings in class-id order",
    )
    window = kwargs.setdefault("shuffle_window", SHUFFLE_WINDOW)
    _dataset_rule(
        isinstance(window, int) and not isinstance(window, bool) and window >= 0,
        "shuffle_window",
        kwargs,
        "must be a whole number of samples >= 0: the samples shuffled together (whole row "
        f"groups; e.g. {SHUFFLE_WINDOW}), or 0 to shuffle every sample of the split (a row "
        "group read per sample)",
    )


def no_readahead(fs: Any, size: int | None = None) -> dict[str, Any]:
    """Open options that read exactly the ranges asked (object stores read ahead in blocks of
    megabytes by default: image bytes the catalog never needs), and the file's ``size`` when
    known (an object store asks for it otherwise: a request per open)."""
    if is_local(fs):
        return {}
    return {"cache_type": "none", **({"size": size} if size is not None else {})}


FOOTERS_KEPT = 4096  # shard footers a process keeps (a few KB each)
_footers: dict[tuple[str, str, int], pq.FileMetaData] = {}


def cached_footer(fs: Any, path: str, size: int) -> pq.FileMetaData:
    """A shard's footer, read once per process (Ray Data's decode workers live across tasks;
    a dataset reaches each task afresh), by path and size: a resume refuses a changed shard,
    and a rewritten one of the same size and path in one process's life is not expected."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    key = (protocol, path, size)
    meta = _footers.get(key)
    if meta is None:
        with fs.open(path, "rb", **no_readahead(fs, size)) as f:
            meta = read_footer(f, size)
        if len(_footers) >= FOOTERS_KEPT:
            _footers.clear()
        _footers[key] = meta
    return meta


def list_shards(fs: Any, root: str) -> tuple[list[Shard], list[str]]:
    """The shards under ``root``, sorted by name: every ``*.parquet`` file at any depth, by its
    exact name (never glob-expanded); and the hidden ones left out (``.x``, ``_SUCCESS``...)."""
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    shards, hidden = [], []
    for full, info in sorted(found.items()):
        name = posixpath.relpath(full, root)
        if not name.lower().endswith(SHARD_SUFFIXES):
            continue
        if any(part.startswith((".", "_")) for part in name.split("/")):
            hidden.append(name)
        else:
            shards.append(Shard(full, name, int(info.get("size") or 0)))
    return shards, hidden


def read_footer(f: Any, size: int) -> pq.FileMetaData:
    """A shard's footer from its last bytes alone: the 8-byte tail (length, ``PAR1``), then the
    footer itself -- two small reads. pyarrow's own reader fetches the last 64 KiB, which on a
    small shard is image bytes too."""
    f.seek(size - 8)
    tail = f.read(8)
    length, magic = struct.unpack("<i4s", tail)
    if magic != b"PAR1" or not 0 < length <= size - 12:
        raise ValueError("not a Parquet file (no PAR1 footer)")
    f.seek(size - 8 - length)
    footer = f.read(length)
    return pq.read_metadata(io.BytesIO(b"PAR1" + footer + tail))


def hf_names(meta: pq.FileMetaData, label_column: str) -> list[str] | None:
    """The class names a Hugging Face dataset keeps in its schema (a ClassLabel), or None."""
    raw = (meta.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    try:
        label = json.loads(raw)["info"]["features"][label_column]
        return [str(n) for n in label["names"]]
    except (TypeError, KeyError, ValueError):
        return None


def check_columns(meta: pq.FileMetaData, columns: dict[str, str], url: str) -> None:
    """The shard has both columns, of types that can be images and labels: from its footer,
    before a byte of data is read -- a column of another type would make every row a bad
    one, a run that trains on nothing."""
    schema = meta.schema.to_arrow_schema()
    for key, column in columns.items():
        if column not in schema.names:
            raise ConfigError(
                f"dataset.{key}",
                column,
                f"is not a column of shard {url} (its columns: {names(schema.names)})",
            )
    image, label = (schema.field(columns[k]).type for k in ("image_column", "label_column"))
    if not _encoded_images(image):
        paths = " (file paths? ftjob reads each image's own bytes from the shard)"
        raise ConfigError(
            "dataset.image_column",
            columns["image_column"],
            f"column of shard {url} holds {image}"
            f"{paths if _is_text(image) else ''}, not encoded images: expected binary (a JPEG, "
            "PNG... file's bytes) or a struct with a binary 'bytes' field (Hugging Face's "
            "Image); python -m ftjob.data.to_parquet writes shards from an image folder",
        )
    if _label_kind_of(label) is None:
        raise ConfigError(
            "dataset.label_column",
            columns["label_column"],
            f"column of shard {url} holds {label}, not labels: expected whole numbers (class "
            "ids) or strings (class names)",
        )


def _encoded_images(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        at = kind.get_field_index("bytes")
        return at >= 0 and _encoded_images(kind.field(at).type)
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or _is_view(kind, "binary")


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_view(kind, "string")


def _is_view(kind: pa.DataType, name: str) -> bool:
    return str(kind) == f"{name}_view"


def _label_kind_of(kind: pa.DataType) -> str | None:
    """``int``, ``float``, ``string`` or ``null`` (a column of nulls only): what a label
    column holds, by its type; None for a type that cannot hold labels."""
    if pa.types.is_dictionary(kind):
        return _label_kind_of(kind.value_type)
    if pa.types.is_integer(kind):
        return "int"
    if pa.types.is_floating(kind):
        return "float"
    if _is_text(kind):
        return "string"
    return "null" if pa.types.is_null(kind) else None


def read_labels(fs: Any, shard: Shard, columns: dict[str, str], url: str) -> ShardLabels:
    """One shard's footer and label column: on local disk its column chunks only (no image
    bytes); on an object store in few requests (:mod:`ftjob.data.ranged_reads`).
    ``columns``: ``{"image_column": name, "label_column": name}``; ``url``: the shard as
    messages name it."""
    label_column = columns["label_column"]

    def check(meta: pq.FileMetaData) -> None:
        check_columns(meta, columns, url)

    try:
        if not is_local(fs):  # an object store: few requests, all at once
            meta, table = read_column_ranged(fs, shard.path, shard.size, label_column, check)
        else:
            with fs.open(shard.path, "rb") as f:
                meta = read_footer(f, shard.size)
                check(meta)
                table = pq.ParquetFile(f, metadata=meta, pre_buffer=False).read(
                    columns=[label_column]
                )
    except (ConfigError, FileNotFoundError, PermissionError):
        raise
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise ValueError(
            f"shard {url} cannot be read as Parquet ({_reason(exc)}): remove or replace it"
        ) from exc
    groups = np.array(
        [meta.row_group(g).num_rows for g in range(meta.num_row_groups)], dtype=np.int64
    )
    labels = table.column(0).combine_chunks()
    sizes = image_group_bytes(meta, image_field(meta, columns["image_column"]))
    return ShardLabels(groups, labels, hf_names(meta, label_column), sizes)


def image_group_bytes(meta: pq.FileMetaData, field: str) -> np.ndarray:
    """The image column's bytes in each row group (uncompressed: what a decoder holds), from
    the footer."""
    at = [i for i in range(meta.num_columns) if meta.schema.column(i).path == field]
    return np.array(
        [
            sum(meta.row_group(g).column(i).total_uncompressed_size for i in at)
            for g in range(meta.num_row_groups)
        ],
        dtype=np.int64,
    )


FOOTER_THREADS = 16  # footers and label columns read concurrently (object stores)


def read_split(
    fs: Any,
    shards: list[Shard],
    urls: list[str],
    columns: dict[str, str],
    where: str,
    train: tuple[ShardLabels, str] | None = None,
) -> list[ShardLabels]:
    """A split's shards' footers and labels (:func:`read_labels`, concurrently on an object
    store; ``urls``: the shards as messages name them), their labels as one type
    (:func:`unify_labels`); a validation split's of the training split's kind (``train``: its
    first shard's labels and url). ``where`` (the dataset and split) starts every error."""

    def read(k: int) -> ShardLabels:
        try:
            return read_labels(fs, shards[k], columns, urls[k])
        except ConfigError:
            raise
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc

    with concurrent.futures.ThreadPoolExecutor(1 if is_local(fs) else FOOTER_THREADS) as pool:
        got = list(pool.map(read, range(len(shards))))
    try:
        got = unify_labels(got, urls, columns["label_column"])
        if train is not None and got[0].labels.type != train[0].labels.type:
            raise ValueError(
                f"the label column {columns['label_column']!r} holds {got[0].labels.type} in "
                f"shard {urls[0]} and {train[0].labels.type} in shard {train[1]} of the "
                "training split: write both splits' labels as class ids (whole numbers) or as "
                "class names (strings)"
            )
    except ConfigError:
        raise
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return got


# A row group whose image column holds more than this is said at catalog time: a decoder reads
# and holds a whole group to decode any one of its samples (ImageNet's JPEGs in the 64-row
# groups python -m ftjob.data.to_parquet writes: ~7 MiB).
LARGE_GROUP_BYTES = 64 * 2**20


def large_groups_note(read: list[ShardLabels], shards: list[Shard], folder: str, path: str) -> str:
    """One line when some row groups of a split hold more image bytes than
    :data:`LARGE_GROUP_BYTES` (the largest named, with its figures), else ''."""
    sizes = [(int(b), k, g) for k, got in enumerate(read) for g, b in enumerate(got.group_bytes)]
    large = [size for size in sizes if size[0] > LARGE_GROUP_BYTES]
    if not large:
        return ""
    size, k, g = max(large)
    return (
        f"dataset.path={path}: {len(large)} row group(s) under {folder}/ hold more than "
        f"{LARGE_GROUP_BYTES // 2**20} MiB of images each, the largest {size / 2**20:.0f} MiB "
        f"({int(read[k].groups[g])} rows: shard {shards[k].name} row group {g}): a decoder reads "
        "and holds a whole row group to decode any one of its samples; rewrite the shards with "
        "small row groups (pyarrow.parquet.write_table(..., row_group_size=64), or python -m "
        "ftjob.data.to_parquet from the image folder: 64 rows a group)"
    )


def unify_labels(read: list[ShardLabels], urls: list[str], label_column: str) -> list[ShardLabels]:
    """A split's label columns as one type, so that shards written by different writers (int32
    here, int64 there) make one split: whole numbers as int64 -- floats too, when every value
    is whole (2.0 is class id 2; NaN is no label) -- and names as strings. Shards of another
    kind (numbers here, names there) are refused naming one of each, and a float that is not
    a whole number naming its shard: either would be a class mapping nobody asked for."""
    kinds = [_label_kind_of(got.labels.type) for got in read]
    found = {k: i for i, k in reversed(list(enumerate(kinds)))}  # each kind's first shard
    numbers, text = [k for k in ("int", "float") if k in found], "string" in found
    if numbers and text:
        a, b = found[numbers[0]], found["string"]
        raise ValueError(
            f"the label column {label_column!r} holds numbers in shard {urls[a]} "
            f"({read[a].labels.type}) and strings in shard {urls[b]} ({read[b].labels.type}): "
            "write every shard's labels as class ids (whole numbers) or as class names (strings)"
        )
    target = pa.string() if text else pa.int64()
    out = []
    for got, url in zip(read, urls, strict=True):
        labels = got.labels
        if pa.types.is_dictionary(labels.type):
            labels = labels.dictionary_decode()
        if pa.types.is_floating(labels.type):
            labels = _whole_numbers(labels, url, label_column)
        out.append(dataclasses.replace(got, labels=labels.cast(target)))
    return out


def _whole_numbers(labels: pa.Array, url: str, label_column: str) -> pa.Array:
    """Float labels as whole numbers (NaN: no label), or refused naming the first that is not."""
    values = labels.to_numpy(zero_copy_only=False)  # a null is NaN here
    nan = np.isnan(values)
    broken = np.flatnonzero(~nan & (np.floor(values) != values))
    if len(broken):
        row = int(broken[0])
        raise ValueError(
            f"the label column {label_column!r} of shard {url} holds {labels.type} labels and "
            f"row {row}'s, {float(values[row])!r}, is not a whole number: a label is a class id (a whole "
            "number) or a class name (a string), not a measurement; write the labels as class ids"
        )
    return pa.array(np.where(nan, 0, values).astype(np.int64), mask=nan)


def image_field(meta: pq.FileMetaData, image_column: str) -> str:
    """The image column to read, or its ``bytes`` field when it is a struct (Hugging Face)."""
    kind = meta.schema.to_arrow_schema().field(image_column).type
    nested = pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
    return f"{image_column}.bytes" if nested else image_column


def read_group_images(
    fs: Any, path: str, size: int, meta: pq.FileMetaData, group: int, field: str
) -> list[bytes | None]:
    """The encoded images of one row group: its image column chunk, nothing else."""
    with fs.open(path, "rb", **no_readahead(fs, size)) as f:
        column = (
            pq.ParquetFile(f, metadata=meta, pre_buffer=False)
            .read_row_group(group, columns=[field])
            .column(0)
            .combine_chunks()
        )
    if pa.types.is_struct(column.type):
        column = column.field("bytes")
    return column.to_pylist()


def label_kind(kind: str, label_type: pa.DataType, class_list: list[str] | None) -> str:
    """``dataset.label_kind`` with ``auto`` decided by the column's type."""
    if kind != "auto":
        return kind
    if pa.types.is_integer(label_type):
        return "int"
    return "classes" if class_list is not None else "sorted"


def class_names(kind: str, read: list[ShardLabels], declared: int | None) -> list[str]:
    """The classes of ``int`` or ``sorted`` labels (the training split's shards): for ``int``,
    ``declared`` ids, else a Hugging Face ClassLabel's names, else ids up to the largest."""
    values = [s.labels for s in read]
    if kind == "sorted":
        unique = pc.unique(pa.chunked_array(values).cast(pa.string())).drop_null()
        return sorted_labels(unique.to_pylist())
    if not pa.types.is_integer(values[0].type):
        raise ConfigError(
            "dataset.label_kind",
            kind,
            f"the label column holds {values[0].type}, not class ids: use sorted (or classes "
            "with dataset.classes)",
        )
    if declared is not None:
        return [str(i) for i in range(declared)]
    if read[0].hf_names is not None:
        return read[0].hf_names
    top = max((pc.max(v).as_py() or 0) for v in values)
    return [str(i) for i in range(int(top) + 1)]


def sorted_labels(labels: list[str]) -> list[str]:
    """Class names in class-id order: by value when every name is a whole number ("2" before
    "10", as the numbers they are), else as strings (ImageNet's wnids sort to its class ids)."""
    if all(_WHOLE.fullmatch(name) for name in labels):
        return sorted(labels, key=lambda name: (int(name), name))
    return sorted(labels)


_WHOLE = re.compile(r"[+-]?[0-9]+")


def class_ids(
    labels: pa.ChunkedArray, kind: str, classes: list[str], where: Callable[[int], str]
) -> np.ndarray:
    """Class ids of a split's labels, in one pass; -1 where a row has none (null; a negative
    id, as Hugging Face's -1 of an unlabelled split). A label outside the classes is refused,
    ``where(row)`` naming the shard of the first such row."""
    if kind == "int":
        ids = np.concatenate(
            [c.cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False) for c in labels.chunks]
        )
        ids = np.where(ids < 0, -1, ids)
        out = np.flatnonzero(ids >= len(classes))
        if len(out):
            raise ValueError(
                f"{where(int(out[0]))} has label {int(ids[out[0]])}, outside the {len(classes)} "
                f"classes 0..{len(classes) - 1}: set dataset.num_classes, or fix the shard"
            )
        return ids
    index = pc.index_in(labels.cast(pa.string()), value_set=pa.array(classes))
    unknown = pc.and_(pc.is_null(index), pc.is_valid(labels))
    if pc.any(unknown).as_py():
        row = int(pc.index(unknown, True).as_py())
        rule = (
            "dataset.classes does not list it"
            if kind == "classes"
            else "the training split has no such label"
        )
        raise ValueError(f"{where(row)} has label {labels[row].as_py()!r}, not a class: {rule}")
    filled = index.cast(pa.int64()).fill_null(-1)
    return np.concatenate([c.to_numpy() for c in filled.chunks])
