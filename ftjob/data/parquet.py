"""Parquet shards of encoded images (``dataset=parquet``, ``dataset=imagenet_parquet``).

A split is a folder of ``*.parquet`` shards (at any depth under ``{path}/{train_dir}``), each
row an encoded image and a label: Ray's ImageNet benchmark layout (``image`` = JPEG bytes,
``label`` = class id string) and Hugging Face's (``image`` = struct ``{bytes, path}``,
integer ``label``) without conversion.

The catalog comes from the shards' footers and their label columns alone: a sample is the
position ``(shard, row group, row)``, so building it, planning an epoch and skipping ahead read
no image bytes. Decoding a block of samples reads the image column (projection) of only the row
groups its rows are in, each once, with the footer each process read once per shard. A changed
shard (list, sizes, row counts) changes the train fingerprint, which a resume refuses with the
diff; a row whose bytes do not decode, or that has no label, is a bad row under
``dataset.bad_files``, named by shard and row.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ftjob.config import ConfigError
from ftjob.data.bad_files import over_budget
from ftjob.data.datasets import (
    SOURCES,
    TRAIN,
    VAL,
    BadFile,
    DataError,
    Encoded,
    ImageFolderDataset,
    _reason,
    with_keys_of,
)
from ftjob.data.folders import names
from ftjob.data.order import ShuffleWindows
from ftjob.data.row_groups import catalog_windows, group_images
from ftjob.data.shards import (
    SHUFFLE_WINDOW,
    Shard,
    ShardLabels,
    cached_footer,
    check_parquet_args,
    class_ids,
    class_names,
    image_field,
    label_kind,
    large_groups_note,
    list_shards,
    read_group_images,
    read_split,
)

SHARD, GROUP, ROW = "shard", "group", "row"  # catalog columns: a sample's position
NO_LABEL = "no_label"  # catalog column: a row without a label (bad_files=skip)
NO_LABEL_REASON = "no label (the label column is null)"


class ParquetDataset(ImageFolderDataset):
    """Images stored as encoded bytes in Parquet shards, ``{path}/{train_dir}/**.parquet`` and
    ``{path}/{val_dir}/**.parquet``, on any fsspec URL; decoded with the image keys and
    transforms of :class:`ImageFolderDataset`.

    Labels (``label_kind``): ``int`` -- the column holds class ids; ``classes`` -- strings
    mapped through ``classes`` (the list's order is the class id); ``sorted`` -- strings mapped
    through the sorted set of the training split's values (ImageNet's wnids sort to its class
    ids); ``auto`` -- ``int`` for an integer column, else ``classes`` when given, else
    ``sorted``.

    ``image``: the image keys of :class:`ImageFolderDataset` (``train_dir``, ``image_size``,
    ``bad_files``...), checked and kept by its constructor; all but ``follow_links`` (shards
    are files, not a tree of links)."""

    def __init__(
        self,
        path: str,
        *,
        image_column: str = "image",
        label_column: str = "label",
        label_kind: str = "auto",
        classes: list[str] | None = None,
        shuffle_window: int = SHUFFLE_WINDOW,
        **image: Any,
    ) -> None:
        own = {
            "image_column": image_column,
            "label_column": label_column,
            "label_kind": label_kind,
            "classes": classes,
            "shuffle_window": shuffle_window,
        }
        self.__signature__.bind(path, **own, **image)  # a key it does not take: TypeError
        check_parquet_args(own)
        super().__init__(path, **image)
        self.image_column, self.label_column = image_column, label_column
        self.label_kind = label_kind
        self.class_list = list(classes) if classes is not None else None
        self.shuffle_window = shuffle_window
        self._shards: dict[str, list[Shard]] = {}
        self._read: dict[str, list[ShardLabels]] = {}
        self._sizes: dict[str, int] = {}  # shard path -> size, as listed: kept when pickled
        self._image_field: str | None = None  # "image" or "image.bytes" (a struct)

    # Its keys as the config's checks (ftjob.config.targets) and help() read them: its own,
    # then the image keys.
    __signature__ = with_keys_of(__init__, ImageFolderDataset.__init__, drop=("follow_links",))

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        super().check_args(**kwargs)
        check_parquet_args(kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {**state, "_shards": {}, "_read": {}}

    # -- listing and the catalog (driver) -----------------------------------------------

    def _split_dir(self, split: str) -> str:
        return self.train_dir if split == TRAIN else self.val_dir

    def shards(self, split: str) -> list[Shard]:
        """The split's shards (:func:`~ftjob.data.shards.list_shards`), listed once."""
        if split in self._shards:
            return self._shards[split]
        root = self._root(split)
        shards, hidden = list_shards(self.fs, root)
        folder = self._split_dir(split)
        if hidden:
            self._notes.setdefault(split, []).append(
                f"dataset.path={self.path}: skipped {len(hidden)} hidden shard(s) under "
                f"{folder}/ (e.g. {hidden[0]}): a name starting with '.' or '_' is not a shard"
            )
        if not shards:
            raise FileNotFoundError(
                f"dataset.path={self.path!r}: no Parquet shards under {split} folder {root!r}; "
                f"expected {self.path}/{folder}/<shard>.parquet"
            )
        self._shards[split] = shards
        self._sizes.update((s.path, s.size) for s in shards)
        return shards

    def _read_split(self, split: str) -> list[ShardLabels]:
        """Every shard's footer and labels, as one split (:func:`~ftjob.data.shards.read_split`)."""
        if split not in self._read:
            shards, urls = self.shards(split), [self._url(s.path) for s in self.shards(split)]
            columns = {"image_column": self.image_column, "label_column": self.label_column}
            first = self._url(self.shards(TRAIN)[0].path)
            train = None if split == TRAIN else (self._read_split(TRAIN)[0], first)
            where = f"dataset.path={self.path!r} ({split})"
            self._read[split] = read_split(self.fs, shards, urls, columns, where, train)
            note = large_groups_note(self._read[split], shards, self._split_dir(split), self.path)
            self._notes.setdefault(split, []).extend([note] if note else [])
        return self._read[split]

    def _kind(self) -> str:
        label_type = self._read_split(TRAIN)[0].labels.type
        return label_kind(self.label_kind, label_type, self.class_list)

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            self._classes = self._class_names()
            declared = self.declared_classes
            if declared is not None and len(self._classes) != declared:
                raise ConfigError(
                    "dataset.num_classes",
                    declared,
                    f"{self.path} has {len(self._classes)} classes in the label column "
                    f"{self.label_column!r} of {self.train_dir}/ ({names(self._classes)}): set "
                    f"dataset.num_classes={len(self._classes)}, or null to count them",
                )
        return self._classes

    def _class_names(self) -> list[str]:
        kind = self._kind()
        if kind == "classes":
            assert self.class_list is not None
            return list(self.class_list)
        return class_names(kind, self._read_split(TRAIN), self.declared_classes)

    def catalog(self, split: str) -> pa.Table:
        shards, read = self.shards(split), self._read_split(split)
        parts: dict[str, list[np.ndarray]] = {k: [] for k in (SHARD, GROUP, ROW)}
        for k, got in enumerate(read):
            rows = int(got.groups.sum())
            parts[SHARD].append(np.full(rows, k, dtype=np.int32))
            parts[GROUP].append(np.repeat(np.arange(len(got.groups), dtype=np.int32), got.groups))
            parts[ROW].append(np.arange(rows, dtype=np.int64))
        starts = np.cumsum([0] + [int(got.groups.sum()) for got in read])

        def where(row: int) -> str:
            shard = shards[int(np.searchsorted(starts, row, side="right")) - 1]
            return f"dataset.path={self.path!r}: shard {self._url(shard.path)} ({split})"

        values = pa.chunked_array([got.labels for got in read])
        labels = class_ids(values, self._kind(), self.classes, where)
        missing = labels < 0
        if missing.any():
            first = int(np.flatnonzero(missing)[0])
            shard = shards[int(np.concatenate(parts[SHARD])[first])]
            at = f"{self._url(shard.path)} row {int(np.concatenate(parts[ROW])[first])}"
            check_unlabelled(self, split, missing, at)
        index = pa.array(np.concatenate(parts[SHARD]))
        columns: dict[str, Any] = {
            "id": np.arange(len(labels), dtype=np.int64),
            "label": np.where(missing, 0, labels),
            SHARD: pa.DictionaryArray.from_arrays(index, pa.array([s.path for s in shards])),
            GROUP: np.concatenate(parts[GROUP]),
            ROW: np.concatenate(parts[ROW]),
        }
        if missing.any():
            columns[NO_LABEL] = missing
        table = pa.table(columns)
        stated = json.dumps(shard_sources(table, shards, read)).encode()
        return table.replace_schema_metadata({SOURCES: stated})

    def shuffle_windows(self, catalog: pa.Table) -> ShuffleWindows | None:
        return catalog_windows(catalog, self.shuffle_window)

    def catalog_notes(self) -> list[str]:
        notes: list[str] = []
        for split in (TRAIN, VAL):
            self._read_split(split)  # listed and read once: its notes come with them
            notes.extend(self._notes.get(split, []))
        return notes

    # -- decoding (workers, Ray Data tasks) ---------------------------------------------

    def _footer(self, path: str) -> pq.FileMetaData:
        return cached_footer(self.fs, path, self._size(path))

    def _size(self, path: str) -> int:
        if path not in self._sizes:  # a dataset pickled before its catalog was built
            self._sizes[path] = int(self.fs.size(path))
        return self._sizes[path]

    def _group_images(self, path: str, group: int) -> list[Any]:
        meta = self._footer(path)
        if self._image_field is None:
            self._image_field = image_field(meta, self.image_column)
        return read_group_images(self.fs, path, self._size(path), meta, group, self._image_field)

    def _group_key(self, key: tuple[str, int]) -> tuple[tuple[str, int, int], int]:
        """A row group as a cache holds it (a shard rewritten in place is another), and its rows."""
        return (*key, self._size(key[0])), self._footer(key[0]).row_group(key[1]).num_rows

    def _where(self, path: str, row: int, group: int) -> str:
        return f"dataset shard {self._url(path)} row {row} (row group {group})"

    def _group_start(self, path: str, group: int) -> int:
        meta = self._footer(path)
        return sum(meta.row_group(g).num_rows for g in range(group))

    def _row_image(self, data: Any, where: str, train: bool, rng: np.random.Generator) -> Any:
        if data is None:
            raise DataError(
                f"{where} has no image bytes (the image column is null): fix the shard, or "
                "set dataset.bad_files=skip"
            )
        return self._decoded(
            data, train, rng, where, "fix the shard, or set dataset.bad_files=skip"
        )

    def encoded(self, rows: dict[str, np.ndarray], split: str, epoch: int) -> Encoded:
        paths, groups, shard_rows = rows[SHARD], rows[GROUP], rows[ROW]
        no_label = rows.get(NO_LABEL)
        skipped = np.zeros(len(paths), bool) if no_label is None else np.asarray(no_label, bool)
        skipped = skipped.copy()
        # Each row group this block needs is read once (its image column only), in the order
        # the block first needs them; within a shuffle window, once for all its blocks.
        wanted = dict.fromkeys(
            (str(p), int(g)) for p, g, s in zip(paths, groups, skipped, strict=True) if not s
        )
        held = (self.path, self._split_dir(split), self.image_column, epoch)
        images_of = group_images(
            wanted, self._group_images, self._group_key, held, self.shuffle_window
        )
        starts = {key: self._group_start(*key) for key in wanted}
        data, names = [], []
        for k in range(len(paths)):
            key, row = (str(paths[k]), int(groups[k])), int(shard_rows[k])
            names.append(self._where(key[0], row, key[1]))
            data.append(None if skipped[k] else images_of[key][row - starts[key]])
        return Encoded(data, skipped, names)

    def decode_encoded(self, data: Any, name: str, train: bool, rng: np.random.Generator) -> Any:
        return self._row_image(data, name, train, rng)

    def check_row(self, row: dict[str, Any]) -> str | None:
        """Why one catalog row cannot be a sample (decoded as validation decodes it), or None."""
        if row.get(NO_LABEL):
            return NO_LABEL_REASON
        path, group = str(row[SHARD]), int(row[GROUP])
        data = self._group_images(path, group)[int(row[ROW]) - self._group_start(path, group)]
        try:
            self._row_image(data, "", False, np.random.default_rng(0))
        except DataError as exc:
            cause = exc.__cause__
            return _reason(cause) if cause is not None else "no image bytes"
        return None

    def bad_file(self, row: dict[str, Any]) -> BadFile:
        where = f"{self._url(str(row[SHARD]))} row {int(row[ROW])}"
        return BadFile(where, self.check_row(row) or "did not decode")

    def describe(self) -> str:
        return f"ParquetDataset({self.path})"


def check_unlabelled(dataset: ParquetDataset, split: str, missing: np.ndarray, first: str) -> None:
    """Rows without a label (``missing``; ``first``: the first's shard and row) are refused
    under ``dataset.bad_files=fail``, and past ``dataset.max_bad_fraction`` of the split under
    ``skip``: known before anything trains."""
    count = int(missing.sum())
    if dataset.bad_files != "skip":
        raise ValueError(
            f"dataset shard {first} ({split}): {NO_LABEL_REASON}; {count} row(s) of {split} "
            "have none: fix the shards, or set dataset.bad_files=skip"
        )
    example = f"{first}: {NO_LABEL_REASON}"
    over = over_budget(split, count, len(missing), dataset.max_bad_fraction, example)
    if over:
        raise ValueError(f"dataset.path={dataset.path!r}: {over}")


def shard_sources(table: pa.Table, shards: list[Shard], read: list[ShardLabels]) -> dict[str, Any]:
    """The split as a checkpoint remembers it (the train fingerprint): a hash of the labels
    and positions, and every shard's name, row count and size -- a resume diffs shard by
    shard. Names are under the split folder: a copy elsewhere is the same data."""
    digest = hashlib.sha256()
    for name in ("label", GROUP, ROW):
        digest.update(name.encode() + np.ascontiguousarray(table.column(name)).tobytes())
    out: dict[str, Any] = {"train_sha256": digest.hexdigest()[:32], "shards": len(shards)}
    for shard, got in zip(shards, read, strict=True):
        out[f"shard {shard.name}"] = f"{int(got.groups.sum())} rows, {shard.size} bytes"
    return out
