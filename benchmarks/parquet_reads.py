"""Parquet reads per sample and decode rates, by ``dataset.shuffle_window``, beside the folder;
and a worker's decode pool (``trainer.use_gpu=true``: the CPUs it reserves but one).

The same JPEGs as throughput.py (256 px, 8 classes), as files and as Parquet shards (ftjob's
writer: shuffled rows, 256 a shard, ``--rows-per-group`` a row group). In one process, no Ray
cluster, rank 0 of world 1 (and of world 2 for the reads), batches of 64 cropped to 64 px:

  plan      an epoch's plan and a resume position at 90 % at ImageNet's shape, by window;
  reads     bytes read from the shards while an epoch decodes, over the image bytes the epoch
            decodes (1.0: each row group read once), and row groups read per window;
  decode    images/s of an epoch through the in-process stream (the in-worker decode path):
            Parquet at each window, the folder; parquet/folder ratios;
  pool      images/s of a training loop on one torch thread (small_cnn) fed by the stream
            decoding with 1 thread (a CPU worker's) and with N threads (a GPU worker that
            reserves N+1 CPUs); pool/one ratio. Also decode alone at 1 and N threads.

Variants run interleaved, ``--repeats`` times; medians are printed.

    python benchmarks/parquet_reads.py [--repeats 3] [--threads 2] [--rows-per-group 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import JPEGS, write_jpeg_tree  # noqa: E402

from ftjob.data import row_groups  # noqa: E402
from ftjob.data.datasets import TRAIN, ImageFolderDataset  # noqa: E402
from ftjob.data.order import EpochPlan  # noqa: E402
from ftjob.data.parquet import ParquetDataset  # noqa: E402
from ftjob.data.to_parquet import convert  # noqa: E402

BATCH = 64
KEYS = {"image_size": 64, "resize_size": 73, "augment": True}


class CountingFS(LocalFileSystem):
    """Local files; every byte read through it counted."""

    cachable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bytes = 0

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        fs, read, readinto = self, f.read, getattr(f, "readinto", None)

        def counted_read(n: int = -1) -> bytes:
            data = read(n)
            fs.bytes += len(data)
            return data

        def counted_readinto(buffer: Any) -> int:
            got = readinto(buffer)  # type: ignore[misc]
            fs.bytes += got or 0
            return got

        f.read = counted_read
        if readinto is not None:
            f.readinto = counted_readinto
        return f


def _parquet(shards: str, window: int) -> ParquetDataset:
    return ParquetDataset(shards, shuffle_window=window, **KEYS)  # type: ignore[arg-type]


def _ids(ds: Any, catalog: pa.Table, rank: int = 0, world: int = 1) -> np.ndarray:
    plan = EpochPlan(catalog.num_rows, BATCH, 0, ds.shuffle_windows(catalog))
    return plan.shard(0, 0, rank, world)


def reads(shards: str, window: int, world: int) -> tuple[float, float]:
    """(bytes read / image bytes decoded, row groups read per window) over every rank, each
    rank in a process of its own (caches cleared between ranks)."""
    import pyarrow.parquet as pq

    ds = _parquet(shards, window)
    fs = ds._fs = CountingFS()
    catalog = ds.catalog(TRAIN)
    group_bytes: dict[tuple[str, int], int] = {}
    for path in {str(p) for p in catalog.column("shard").to_pylist()}:
        meta = pq.read_metadata(path)
        for g in range(meta.num_row_groups):
            group_bytes[(path, g)] = meta.row_group(g).column(0).total_compressed_size
    rows_of = {key: 0 for key in group_bytes}
    for path, g in zip(
        catalog.column("shard").to_pylist(), catalog.column("group").to_pylist(), strict=True
    ):
        rows_of[(str(path), int(g))] += 1
    needed, read_groups = 0.0, 0
    counted = ds._group_images

    def counting(path: str, group: int) -> list[Any]:
        nonlocal read_groups
        read_groups += 1
        return counted(path, group)

    ds._group_images = counting  # type: ignore[method-assign]
    fs.bytes = 0
    for rank in range(world):
        row_groups._caches.clear()
        ids = _ids(ds, catalog, rank, world)
        rows = catalog.take(pa.array(ids))
        for path, g in zip(
            rows.column("shard").to_pylist(), rows.column("group").to_pylist(), strict=True
        ):
            key = (str(path), int(g))
            needed += group_bytes[key] / rows_of[key]  # a row's share of its group's images
        for start in range(0, len(ids), 128):  # a stream's blocks (128 samples)
            block = rows.slice(start, 128).to_pydict()
            cols = {
                k: np.asarray(v, dtype=object if k == "shard" else None) for k, v in block.items()
            }
            ds.decode_batch(cols, TRAIN, 0, 0)
    plan = EpochPlan(catalog.num_rows, BATCH, 0, ds.shuffle_windows(catalog))
    windows = 1 if plan.windows is None else int(plan.windows.window_index(0, 0).max()) + 1
    return fs.bytes / needed, read_groups / world / windows


def decode_rate(ds: Any, threads: int = 1) -> float:
    """Images/s of one epoch decoded by the in-process stream (no training)."""
    from ftjob.data.streams import InProcessStream

    row_groups._caches.clear()
    catalog = ds.catalog(TRAIN)
    ids = _ids(ds, catalog)
    stream = InProcessStream(ds, catalog, TRAIN, seed=0, threads=threads)
    start = time.perf_counter()
    n = sum(len(b.ids) for b in stream.batches(ids, BATCH, epoch=0))
    return n / (time.perf_counter() - start)


def train_rate(ds: Any, threads: int) -> float:
    """Images/s of an epoch trained on one torch thread, fed by the stream's decode threads."""
    import torch
    import torch.nn.functional as F

    from ftjob.data.streams import InProcessStream
    from ftjob.worker.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model({"_target_": "ftjob.models.SmallCNN", "width": 32}, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    row_groups._caches.clear()
    catalog = ds.catalog(TRAIN)
    stream = InProcessStream(ds, catalog, TRAIN, seed=0, threads=threads, prefetch_batches=2)
    start, n = time.perf_counter(), 0
    for batch in stream.batches(_ids(ds, catalog), BATCH, epoch=0):
        loss = F.cross_entropy(model(batch.images), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += len(batch.ids)
    return n / (time.perf_counter() - start)


def plan_times(repeats: int) -> None:
    """An epoch's order and rank 0's ids from 90 % of it (global batch 1024 over 8 ranks) at
    ImageNet's shape (1,281,167 rows in row groups of 64), windowed and whole-split."""
    from ftjob.data.order import ShuffleWindows

    windows = ShuffleWindows.of_groups(np.array([64] * 20018 + [15]), 4096)
    n = windows.num_samples
    at = int(0.9 * n) // 1024 * 1024
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, w in (("shuffle_window=4096", windows), ("shuffle_window=0", None)):
            start = time.perf_counter()
            EpochPlan(n, 1024, 0, w).shard(0, at, 0, 8)
            times.setdefault(name, []).append(time.perf_counter() - start)
    for name, got in times.items():
        print(f"  plan + resume at 90 %, {n} rows, {name}: {statistics.median(got):.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="the pool: reserved CPUs - 1")
    parser.add_argument("--rows-per-group", type=int, default=64)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        tree, shards = os.path.join(tmp, "tree"), os.path.join(tmp, "pq")
        write_jpeg_tree(tree)
        convert(tree, shards, 256, rows_per_group=args.rows_per_group)
        print(f"{JPEGS['train']} training JPEGs; shards of 256 rows, {args.rows_per_group} a group")
        plan_times(max(3, args.repeats))
        windows = [0, 256, 1024, 4096]

        print("\nreads (bytes read / image bytes decoded; row groups read per window a rank)")
        for world in (1, 2):
            for w in windows:
                amp, per_window = reads(shards, w, world)
                print(f"  world {world} shuffle_window={w:<5} {amp:6.2f}x  {per_window:7.1f}")

        rates: dict[str, list[float]] = {}
        folder = ImageFolderDataset(tree, **KEYS)  # type: ignore[arg-type]
        variants = {f"parquet w={w}": _parquet(shards, w) for w in windows}
        variants["folder"] = folder
        for r in range(args.repeats):
            for name, ds in list(variants.items())[r % 5 :] + list(variants.items())[: r % 5]:
                rates.setdefault(name, []).append(decode_rate(ds))
            for threads in (1, args.threads):
                ds = variants["parquet w=4096"]
                rates.setdefault(f"train, {threads} decode thread(s)", []).append(
                    train_rate(ds, threads)
                )
                rates.setdefault(f"decode, {threads} thread(s)", []).append(
                    decode_rate(ds, threads)
                )
            print(f"repeat {r + 1}: load average {os.getloadavg()[0]:.1f}")
        med = {k: statistics.median(v) for k, v in rates.items()}
        print("\ndecode, images/s (median of", args.repeats, "):")
        for name, rate in med.items():
            print(f"  {name:<28} {rate:8.1f}")
        for w in windows:
            print(f"parquet w={w}/folder = {med[f'parquet w={w}'] / med['folder']:.3f}")
        one, pool = "train, 1 decode thread(s)", f"train, {args.threads} decode thread(s)"
        print(f"train pool/one = {med[pool] / med[one]:.3f}")
        print(
            f"decode pool/one = "
            f"{med[f'decode, {args.threads} thread(s)'] / med['decode, 1 thread(s)']:.3f}"
        )
        print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
