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

With ``--s3`` (a loopback moto server of its own, stopped by pid at the end) or
``--s3-endpoint URL`` (one already running), the same shards are uploaded once to
``s3://ftjob-scale/parquet-ROWS-SHARDS`` and the catalog is built from there as a user's job
builds it (``dataset.storage_options.endpoint_url``, read through s3fs), in a fresh process:
seconds, driver peak, the S3 requests s3fs made by operation, then the plan and the resume
position from that catalog. The JPEG tree is skipped in that mode. The shards' tiny images let
ftjob's reader fetch a shard in one request (:mod:`ftjob.data.ranged_reads`); ``--unmerged``
builds the catalog again with a request per label chunk, as ImageNet's real image sizes need.
(A child inherits its parent's maxrss on Linux: the upload runs in a child too.)

    python benchmarks/parquet_catalog.py [--rows 1281167] [--shards 1000] [--jpegs 100000]
        [--dir /tmp/ftjob-scale] [--s3 | --s3-endpoint URL [--unmerged]]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from storage_bench import moto_server  # noqa: E402

CLASSES = 1000
BUCKET = "ftjob-scale"
UNMERGED_ENV = "PARQUET_CATALOG_UNMERGED"  # --unmerged, for the child
# Loopback credentials only: the child inherits them, no profile or instance metadata is asked.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


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


def count_s3_requests() -> collections.Counter[str]:
    """Every request s3fs makes in this process, by operation (``get_object``...)."""
    import s3fs

    counts: collections.Counter[str] = collections.Counter()
    call = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        counts[method] += 1
        return await call(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    return counts


def measure(kind: str, path: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """In this (fresh) process: build the train catalog of ``kind`` at ``path``."""
    from ftjob.data.datasets import TRAIN, ImageFolderDataset
    from ftjob.data.order import EpochPlan
    from ftjob.data.parquet import ParquetDataset
    from ftjob.driver.resume import catalog_fingerprint

    requests = count_s3_requests() if path.startswith("s3://") else None
    if os.environ.get(UNMERGED_ENV):  # a request per label chunk, as ImageNet's JPEGs need:
        from ftjob.data import ranged_reads  # no gap merged, the tail holds the footer alone

        ranged_reads.HOLE_BYTES = 0
        ranged_reads.TAIL_BYTES = 8
    idle = _peak_mb()
    if kind == "idle":
        return {"peak_mb": idle}
    t0 = time.perf_counter()
    if kind == "parquet":
        dataset = ParquetDataset(path, label_kind="sorted", storage_options=options)
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
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime  # this process's, imports included
    if requests is not None:
        out["requests"] = dict(requests)
    return out


def _child(kind: str, path: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, path, json.dumps(options or {})],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def upload(local: Path, endpoint: str) -> str:
    """``local``'s train and val shards in s3://BUCKET/<its name>, uploaded once: the URL."""
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=endpoint)
    prefix = f"{BUCKET}/{local.name}"
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    if not fs.exists(f"{prefix}/done"):
        for split in ("train", "val"):
            fs.put(str(local / split) + "/", f"{prefix}/{split}/", recursive=True)
        fs.pipe(f"{prefix}/done", b"ok")
    return f"s3://{prefix}"


def print_parquet(label: str, shards: int, pq_: dict[str, Any]) -> None:
    print(
        f"{label}: {pq_['rows']:,} rows / {pq_['classes']} classes in {shards} shards: "
        f"catalog {pq_['catalog_s']:.2f} s, fingerprint {pq_['fingerprint_s']:.3f} s, "
        f"catalog table {pq_['catalog_mb']:.0f} MB, driver peak {pq_['peak_mb']:.0f} MB"
    )
    print(
        f"{label}: epoch plan (order + rank 0 of 8) {pq_['plan_s']:.3f} s; resume at 90 % "
        f"(rank 0's ids from there + its first block's rows) {pq_['resume90_s']:.3f} s"
    )
    if "requests" in pq_:
        total = sum(pq_["requests"].values())
        each = ", ".join(f"{k} {v:,}" for k, v in sorted(pq_["requests"].items()))
        print(
            f"{label}: {total:,} S3 requests ({each}); the driver's CPU {pq_['cpu_s']:.1f} s "
            "(imports included)"
        )


def main_s3(args: argparse.Namespace, local: Path) -> None:
    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    with contextlib.ExitStack() as stack:
        endpoint = args.s3_endpoint or stack.enter_context(moto_server())
        t = time.perf_counter()
        url = _child("upload", str(local), {"endpoint_url": endpoint})["url"]
        print(f"shards uploaded to {url} in {time.perf_counter() - t:.0f} s (or found)")
        options = {"endpoint_url": endpoint}
        print(f"load: {os.getloadavg()[0]:.1f} (1-min average) on {os.cpu_count()} cores")
        idle = _child("idle", url, options)
        print(f"idle process (same imports): peak {idle['peak_mb']:.0f} MB")
        pq_ = _child("parquet", url, options)
        print(f"load after: {os.getloadavg()[0]:.1f} (1-min average)")
        print_parquet("parquet s3", args.shards, pq_)
        if args.unmerged:
            os.environ[UNMERGED_ENV] = "1"
            one = _child("parquet", url, options)
            print(f"load after: {os.getloadavg()[0]:.1f} (1-min average)")
            print_parquet("parquet s3, a request per label chunk", args.shards, one)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_281_167)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--jpegs", type=int, default=100_000)
    parser.add_argument("--dir", default="/tmp/ftjob-scale")
    s3 = parser.add_mutually_exclusive_group()
    s3.add_argument("--s3", action="store_true", help="the catalog on a loopback moto server")
    s3.add_argument("--s3-endpoint", help="the catalog on this S3 endpoint (loopback moto)")
    parser.add_argument(
        "--unmerged",
        action="store_true",
        help="with --s3: the catalog again with every label chunk its own request (as "
        "ImageNet's JPEGs, ~7 MB between two label chunks, would have it)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, options = args.child
        if kind == "upload":  # here, not in the parent: its memory would be the children's
            url = upload(Path(path), json.loads(options)["endpoint_url"])
            print(json.dumps({"url": url}))
            return
        print(json.dumps(measure(kind, path, json.loads(options) or None)))
        return
    base = Path(args.dir)
    t = time.perf_counter()
    local = base / f"parquet-{args.rows}-{args.shards}"
    write_shards(local, args.rows, args.shards)
    print(f"shards written in {time.perf_counter() - t:.0f} s (or found)")
    if args.s3 or args.s3_endpoint:
        main_s3(args, local)
        return
    t = time.perf_counter()
    write_jpeg_tree(base / f"jpegs-{args.jpegs}", args.jpegs)
    print(f"JPEG tree written in {time.perf_counter() - t:.0f} s (or found)")
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average) on {os.cpu_count()} cores")
    idle = _child("idle", "")
    pq_ = _child("parquet", str(base / f"parquet-{args.rows}-{args.shards}"))
    jp = _child("folder", str(base / f"jpegs-{args.jpegs}"))
    print(f"idle process (same imports): peak {idle['peak_mb']:.0f} MB")
    print_parquet("parquet", args.shards, pq_)
    per_file = jp["catalog_s"] / jp["rows"]
    print(
        f"folder: {jp['rows']:,} JPEG files listed in {jp['catalog_s']:.2f} s "
        f"({per_file * 1e6:.1f} us a file), driver peak {jp['peak_mb']:.0f} MB; "
        f"extrapolated to {args.rows:,} files: {per_file * args.rows:.1f} s (not measured)"
    )
    print(f"folder/parquet catalog (extrapolated) = {per_file * args.rows / pq_['catalog_s']:.2f}")


if __name__ == "__main__":
    main()
