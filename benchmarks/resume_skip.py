"""Time to first batch after resuming at 0%, 50% and 90% of an epoch.

Compares ftjob's resumable iterator (slices the epoch order at the saved position: nothing
skipped is read) with skip-by-iteration (the seed benchmark's method: iterate from the start and
drop batches), on the same data, in one run, interleaved and repeated. Datasets: digits,
synthetic, an image folder of JPEG files on local disk, the same JPEGs as Parquet shards
(ftjob's writer; ``dataset=parquet``), and the folder and the shards on a loopback S3 server
(moto; skipped with --no-s3).

    python benchmarks/resume_skip.py [--repeats 3] [--no-s3]

The last line is ``ratio p90/p0 = X`` for ftjob's iterator (worst dataset).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ftjob.data.datasets import (
    TRAIN,
    DigitsDataset,
    ImageDataset,
    ImageFolderDataset,
    SyntheticDataset,
)
from ftjob.data.order import EpochPlan
from ftjob.data.parquet import ParquetDataset
from ftjob.data.streams import Batch, RayDataStream, ResumableIterator
from ftjob.data.to_parquet import convert

POSITIONS = (0.0, 0.5, 0.9)
BATCH = 64


class SkipByIterationIterator:
    """The replay method (Ray's release benchmark): iterate the epoch from its start and drop
    the batches before ``position``. What ftjob's
    ResumableIterator is compared against here."""

    def __init__(self, stream: RayDataStream, plan: EpochPlan, rank: int, world_size: int) -> None:
        self.inner = ResumableIterator(stream, plan, rank, world_size)

    def epoch(self, epoch: int, position: int) -> Iterator[Batch]:
        to_skip = position // self.inner.plan.global_batch_size
        for i, batch in enumerate(self.inner.epoch(epoch, 0)):
            if i >= to_skip:
                yield batch


def make_jpeg_tree(root: Path, classes: int = 4, per_class: int = 500, size: int = 64) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", per_class // 10)):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
                    folder / f"{i}.jpg", quality=90
                )
    return root


def start_s3(tree: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """moto's S3 server on loopback with ``tree`` uploaded to s3://bench/images."""
    import fsspec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.1)
    fs = fsspec.filesystem("s3", endpoint_url=endpoint)
    fs.mkdir("bench")
    fs.put(str(tree) + "/", "bench/images/", recursive=True)
    return server, endpoint, "s3://bench/images"


def first_batch_seconds(iterator: Any, position: int) -> float:
    start = time.perf_counter()
    batches = iterator.epoch(0, position)
    next(iter(batches))
    elapsed = time.perf_counter() - start
    batches.close()  # stop the stream: only the first batch is timed
    return elapsed


def measure(name: str, dataset: ImageDataset, repeats: int) -> list[dict[str, Any]]:
    catalog = dataset.catalog(TRAIN)
    plan = EpochPlan(catalog.num_rows, BATCH, seed=0)
    stream = RayDataStream(dataset, catalog, TRAIN, seed=0, prefetch_batches=2)
    iterators = {
        "ftjob": ResumableIterator(stream, plan, rank=0, world_size=1),
        "skip-by-iteration": SkipByIterationIterator(stream, plan, rank=0, world_size=1),
    }
    positions = {p: int(plan.steps_per_epoch * p) * BATCH for p in POSITIONS}
    times: dict[tuple[str, float], list[float]] = {}
    first_batch_seconds(iterators["ftjob"], 0)  # warm Ray Data's workers once per dataset
    for _ in range(repeats):
        for p, position in positions.items():
            for method, iterator in iterators.items():
                times.setdefault((method, p), []).append(first_batch_seconds(iterator, position))
    rows = []
    for method in iterators:
        medians = {p: statistics.median(times[(method, p)]) for p in POSITIONS}
        rows.append(
            {
                "dataset": name,
                "method": method,
                **{f"p{int(p * 100)}": medians[p] for p in POSITIONS},
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true", help="skip the loopback S3 image folder")
    args = parser.parse_args()

    import ray

    # Credentials for the loopback S3 server, set before Ray starts so its workers inherit them.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    server = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tree = make_jpeg_tree(Path(tmp) / "images")
            shards = Path(tmp) / "shards"
            convert(str(tree), str(shards), 256, rows_per_group=64)
            datasets: list[tuple[str, ImageDataset]] = [
                ("digits", DigitsDataset()),
                ("synthetic 64px", SyntheticDataset(num_samples=8192, image_size=64)),
                (
                    "imagefolder local",
                    ImageFolderDataset(path=str(tree), image_size=64, resize_size=72),
                ),
                (
                    "parquet local",
                    ParquetDataset(path=str(shards), image_size=64, resize_size=72),
                ),
            ]
            if not args.no_s3:
                server, endpoint, url = start_s3(tree)
                import fsspec

                fsspec.filesystem("s3", endpoint_url=endpoint).put(
                    str(shards) + "/", "bench/shards/", recursive=True
                )
                datasets.append(
                    (
                        "parquet s3",
                        ParquetDataset(
                            path="s3://bench/shards",
                            image_size=64,
                            resize_size=72,
                            storage_options={"endpoint_url": endpoint},
                        ),
                    )
                )
                datasets.append(
                    (
                        "imagefolder s3",
                        ImageFolderDataset(
                            path=url,
                            image_size=64,
                            resize_size=72,
                            storage_options={"endpoint_url": endpoint},
                        ),
                    )
                )
            rows = [
                row for name, dataset in datasets for row in measure(name, dataset, args.repeats)
            ]
    finally:
        ray.shutdown()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

    print(f"time to first batch after resuming (median of {args.repeats}, seconds; batch {BATCH})")
    print(f"{'dataset':<20} {'method':<18} {'p0':>8} {'p50':>8} {'p90':>8} {'p90/p0':>7}")
    for r in rows:
        print(
            f"{r['dataset']:<20} {r['method']:<18} {r['p0']:>8.3f} {r['p50']:>8.3f} {r['p90']:>8.3f} {r['p90'] / r['p0']:>7.2f}"
        )
    ours = [r for r in rows if r["method"] == "ftjob"]
    worst = max(ours, key=lambda r: r["p90"] / r["p0"])
    print(f"worst case for ftjob: {worst['dataset']}")
    print(f"ratio p90/p0 = {worst['p90'] / worst['p0']:.2f}")


if __name__ == "__main__":
    main()
