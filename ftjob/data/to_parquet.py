"""``python -m ftjob.data.to_parquet SRC DST --rows-per-shard N``: a class-per-folder image tree
(``SRC/{train,val}/<class>/*.jpg``, any fsspec URL) written as Parquet shards
(``DST/{train,val}/part-00000.parquet``, any fsspec URL) that ``dataset=parquet`` reads.

The image files' bytes are stored as they are (no re-encoding). ``--layout benchmark`` (the
default) writes Ray's ImageNet benchmark columns: ``image`` (the encoded bytes) and ``label``
(the class folder's name); ``--layout huggingface`` writes Hugging Face's: ``image`` a struct
of ``{bytes, path}`` and ``label`` the class id, the class names in the schema as a
ClassLabel. Rows are shuffled (``--seed``; ``--no-shuffle`` keeps the tree's order) so a shard holds
every class, and written
streaming: one row group of files read at a time. Exit 0 when written, 2 when the command is
wrong, 1 when the tree cannot be listed.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ftjob.data.folders import list_split

LAYOUTS = ("benchmark", "huggingface")


@dataclass(frozen=True)
class Written:
    """What one split became: rows, shards, and their folder."""

    split: str
    rows: int
    shards: int
    folder: str


def _schema(layout: str, classes: list[str]) -> pa.Schema:
    if layout == "benchmark":
        return pa.schema([("image", pa.binary()), ("label", pa.string())])
    features = {
        "image": {"_type": "Image"},
        "label": {"names": classes, "_type": "ClassLabel"},
    }
    meta = {"huggingface": json.dumps({"info": {"features": features}})}
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.schema([("image", image), ("label", pa.int64())], metadata=meta)


def _rows(
    fs: Any, files: list[tuple[str, int]], classes: list[str], layout: str, schema: pa.Schema
) -> pa.Table:
    """One row group: the files read (their exact names, never glob-expanded)."""
    paths = [p for p, _ in files]
    data = fs.cat_ranges(paths, None, None)
    if layout == "benchmark":
        return pa.table(
            {"image": pa.array(data, pa.binary()), "label": [classes[c] for _, c in files]},
            schema=schema,
        )
    images = [{"bytes": d, "path": posixpath.basename(p)} for d, p in zip(data, paths, strict=True)]
    return pa.table(
        {"image": images, "label": np.asarray([c for _, c in files], np.int64)}, schema=schema
    )


def _groups(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def convert(
    src: str,
    dst: str,
    rows_per_shard: int,
    *,
    rows_per_group: int = 64,
    layout: str = "benchmark",
    splits: Sequence[str] = ("train", "val"),
    seed: int = 0,
    shuffle: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[Written]:
    """Write each split of the tree at ``src`` as shards under ``dst``; what was written."""
    if layout not in LAYOUTS:
        raise ValueError(f"--layout={layout!r}: must be one of {', '.join(LAYOUTS)}")
    if rows_per_shard < 1 or rows_per_group < 1:
        raise ValueError("--rows-per-shard and --rows-per-group must be >= 1")
    options = storage_options or {}
    src_fs, src_root = fsspec.core.url_to_fs(src, **options)
    dst_fs, dst_root = fsspec.core.url_to_fs(dst, **options)
    listings = {}
    for split in splits:
        root = posixpath.join(src_root, split)
        listings[split] = list_split(src_fs, root, split, src, src_root).by_class
        if not listings[split]:
            raise FileNotFoundError(f"{src}: no images under {split}/<class>/")
    classes = sorted(listings[splits[0]])
    schema = _schema(layout, classes)
    out: list[Written] = []
    for split in splits:
        index = {name: i for i, name in enumerate(classes)}
        unknown = sorted(set(listings[split]) - set(index))
        if unknown:
            raise ValueError(f"{src}: {split}/ has classes {unknown} that {splits[0]}/ has not")
        files = [(p, index[c]) for c in sorted(listings[split]) for p in listings[split][c]]
        if shuffle:  # else the tree's own order: a catalog of the shards is the folder's
            order = np.random.default_rng([seed, len(out)]).permutation(len(files))
            files = [files[i] for i in order]
        folder = posixpath.join(dst_root, split)
        dst_fs.makedirs(folder, exist_ok=True)
        shards = list(_groups(files, rows_per_shard))
        for k, shard in enumerate(shards):
            target = posixpath.join(folder, f"part-{k:05d}.parquet")
            with dst_fs.open(target, "wb") as f, pq.ParquetWriter(f, schema) as writer:
                for group in _groups(shard, rows_per_group):
                    writer.write_table(_rows(src_fs, group, classes, layout, schema))
        out.append(Written(split, len(files), len(shards), dst_fs.unstrip_protocol(folder)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ftjob.data.to_parquet",
        description="Write a class-per-folder image tree as Parquet shards for dataset=parquet.",
    )
    parser.add_argument("src", help="the tree's root: SRC/train/<class>/*.jpg, SRC/val/...")
    parser.add_argument("dst", help="where the shards go: DST/train/part-00000.parquet, ...")
    parser.add_argument("--rows-per-shard", type=int, required=True)
    parser.add_argument(
        "--rows-per-group",
        type=int,
        default=64,
        help="rows per row group: the unit a decode reads (default 64)",
    )
    parser.add_argument("--layout", choices=LAYOUTS, default="benchmark")
    parser.add_argument("--splits", nargs="+", default=["train", "val"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the row shuffle")
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep the tree's order (class, then name): the shards' catalog is the folder's",
    )
    parser.add_argument(
        "--storage-options",
        default="{}",
        help="fsspec options for SRC and DST, as JSON (e.g. '{\"endpoint_url\": ...}')",
    )
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.storage_options)
        written = convert(
            args.src,
            args.dst,
            args.rows_per_shard,
            rows_per_group=args.rows_per_group,
            layout=args.layout,
            splits=args.splits,
            seed=args.seed,
            shuffle=not args.no_shuffle,
            storage_options=options,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"ftjob.data.to_parquet: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    for w in written:
        print(f"{w.split}: {w.rows} rows in {w.shards} shard(s) under {w.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Written", "convert", "main"]
