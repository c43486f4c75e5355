"""The data path at ImageNet's shape: catalog build, epoch plan and a resume position, on the
driver, for 1,281,167 training rows of 1,000 classes.

  - Parquet: shards in Ray's benchmark layout (``image`` = a tiny JPEG's bytes, ``label`` = a
    wnid-like string), written with ftjob's own row groups (64 rows); the catalog built by
    ``dataset=parquet`` from the footers and label columns, then the train fingerprint a
    checkpoint keeps;
  - a JPEG class-per-folder tree of ``--jpegs`` files (>= 100 k), listed by
    ``dataset=imagefolder``; its per-file cost extrapolated to 1.28 M files (stated as such);
  - then, from the Parquet catalog: an epoch's order and plan, and rank 0's ids from the
    position at 90 % of the epoch (a resume there), global batch 1024 over 8 ranks.

Each build runs in a fresh process (its peak memory is the process's maxrss; the baseline of
an idle process with the same imports is printed beside it).

    python benchmarks/parquet_catalog.py [--rows 1281167] [--shards 1000] [--jpegs 100000]
        [--dir /tmp/ftjob-scale]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CLASSES = 1000


def tiny_jpegs(n: int) -> list[bytes]:
    """``n`` distinct 8x8 JPEGs (one per class)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        img = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=80)
        out.append(buf.getvalue())
    return out


def write_shards(root: Path, rows: int, shards: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = root / "done"
    if done.exists():
        return
    images = tiny_jpegs(CLASSES)
    wnids = [f"n{10_000_000 + c:08d}" for c in range(CLASSES)]
    rng = np.random.default_rng(1)
    per = -(-rows // shards)
    schema = pa.schema([("image", pa.binary()), ("label", pa.string())])
    (root / "val").mkdir(parents=True, exist_ok=True)
    for split, count, n_shards in (("train", rows, shards), ("val", 50_000, 50)):
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        per = -(-count // n_shards)
        for k in range(n_shards):
            n = min(per, count - k * per)
            labels = rng.integers(0, CLASSES, n)
            table = pa.table(
                {"image": [images[c] for c in labels], "label": [wnids[c] for c in labels]},
                schema=schema,
            )
            pq.write_table(
                table, folder / f"part-{k:05d}.parquet", row_group_size=64, use_dictionary=False
            )
    done.write_text("ok")


def write_jpeg_tree(root: Path, files: int) -> None:
    done = root / "done"
    if done.exists():
        return
    images = tiny_jpegs(CLASSES)
    for split, count in (("train", files), ("val", CLASSES)):
        for i in range(count):
            c = i % CLASSES
            folder = root / split / f"n{10_000_000 + c:08d}"
            if i < CLASSES:
                folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i:07d}.JPEG").write_bytes(images[c])
    done.write_text("ok")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(kind: str, path: str) -> dict[str, float]:
    """In this (fresh) process: build the train catalog of ``kind`` at ``path``."""
    from ftjob.data.datasets import TRAIN, ImageFolderDataset
    from ftjob.data.order import EpochPlan
    from ftjob.data.parquet import ParquetDataset
    from ftjob.driver.resume import catalog_fingerprint

    idle = _peak_mb()
    if kind == "idle":
        return {"peak_mb": idle}
    t0 = time.perf_counter()
    if kind == "parquet":
        dataset = ParquetDataset(path, label_kind="sorted")
    else:
        dataset = ImageFolderDataset(path)
    table = dataset.catalog(TRAIN)
    t1 = time.perf_counter()
    fingerprint = catalog_fingerprint(table, dataset.num_classes)
    t2 = time.perf_counter()
    out = {
        "rows": table.num_rows,
        "classes": dataset.num_classes,
        "catalog_s": t1 - t0,
        "fingerprint_s": t2 - t1,
        "catalog_mb": table.nbytes / 2**20,
        "fingerprint_keys": len(fingerprint),
    }
    if kind == "parquet":
        t3 = time.perf_counter()
        plan = EpochPlan(table.num_rows, 1024, 0)
        first = plan.shard(0, 0, 0, 8)
        t4 = time.perf_counter()
        at = int(plan.steps_per_epoch * 0.9) * 1024
        resumed = plan.shard(0, at, 0, 8)
        ids = table.take(resumed[:128])  # the first block's catalog rows
        t5 = time.perf_counter()
        out.update(
            plan_s=t4 - t3, resume90_s=t5 - t4, first_ids=len(first), resume_ids=len(resumed)
        )
        assert ids.num_rows == 128
    out["peak_mb"] = _peak_mb()
    return out


def _child(kind: str, path: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, path], capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_281_167)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--jpegs", type=int, default=100_000)
    parser.add_argument("--dir", default="/tmp/ftjob-scale")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    base = Path(args.dir)
    t = time.perf_counter()
    write_shards(base / f"parquet-{args.rows}-{args.shards}", args.rows, args.shards)
    print(f"shards written in {time.perf_counter() - t:.0f} s (or found)")
    t = time.perf_counter()
    write_jpeg_tree(base / f"jpegs-{args.jpegs}", args.jpegs)
    print(f"JPEG tree written in {time.perf_counter() - t:.0f} s (or found)")
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average) on {os.cpu_count()} cores")
    idle = _child("idle", "")
    pq_ = _child("parquet", str(base / f"parquet-{args.rows}-{args.shards}"))
    jp = _child("folder", str(base / f"jpegs-{args.jpegs}"))
    print(f"idle process (same imports): peak {idle['peak_mb']:.0f} MB")
    print(
        f"parquet: {pq_['rows']:,} rows / {pq_['classes']} classes in {args.shards} shards: "
        f"catalog {pq_['catalog_s']:.2f} s, fingerprint {pq_['fingerprint_s']:.3f} s, "
        f"catalog table {pq_['catalog_mb']:.0f} MB, driver peak {pq_['peak_mb']:.0f} MB"
    )
    print(
        f"parquet: epoch plan (order + rank 0 of 8) {pq_['plan_s']:.3f} s; resume at 90 % "
        f"(rank 0's ids from there + its first block's rows) {pq_['resume90_s']:.3f} s"
    )
    per_file = jp["catalog_s"] / jp["rows"]
    print(
        f"folder: {jp['rows']:,} JPEG files listed in {jp['catalog_s']:.2f} s "
        f"({per_file * 1e6:.1f} us a file), driver peak {jp['peak_mb']:.0f} MB; "
        f"extrapolated to {args.rows:,} files: {per_file * args.rows:.1f} s (not measured)"
    )
    print(f"folder/parquet catalog (extrapolated) = {per_file * args.rows / pq_['catalog_s']:.2f}")


if __name__ == "__main__":
    main()
