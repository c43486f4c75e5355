"""The GPU input path, side by side on one machine: ResNet-50 at 224 px, bf16, channels_last,
one GPU worker, images/s from the first step to the end of training.

  plain torch          batches already on the GPU (the limit: no data path at all)
  ftjob device folder  trainer.decode_in=device on a folder of ImageNet-like JPEGs made here
                       (400x350, ~110 KB, quality 90; a few progressive and CMYK among them)
  ftjob device parquet the same files as Parquet shards (ftjob's writer)
  ftjob worker         trainer.decode_in=worker: the worker's PIL pool on its reserved CPUs
  ray data loop        the seed benchmark's pipeline: a hand-written Ray Train loop with Ray
                       Data decoding the files on the CPUs (benchmarks/handwritten.py)
Targets: ftjob from the folder and from Parquet >= 0.9x plain torch and >= 2x the Ray Data loop.
Each ftjob run's summary gives where its time went (data/read, copy, decode, augment, step).

    python benchmarks/gpu_input.py [--train 16384] [--epochs 2] [--batch 128]
    python benchmarks/gpu_input.py --device cpu --train 48 --val 8 --epochs 1 --batch 8 \\
        --model small_cnn --image-size 32 --resize 36      # a dry run of every part on a CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from ftjob import metrics as M  # noqa: E402
from tests.support.images import jpeg, photo_like  # noqa: E402

MODELS = {
    "resnet50": {"_target_": "torchvision.models.resnet50", "weights": None},
    "small_cnn": {"_target_": "ftjob.models.SmallCNN", "width": 16},
}
CLASSES = 8
STAGES = (M.DATA_READ, M.DATA_COPY, M.DATA_DECODE, M.DATA_AUGMENT, M.TRAIN_STEP)


def _file(task: tuple[str, int]) -> None:
    """One ImageNet-like JPEG: 1 in 100 progressive, 1 in 200 CMYK (the device's fallbacks)."""
    path, seed = task
    pixels = photo_like(seed)
    if seed % 100 == 7:
        data = jpeg(pixels, progressive=True)
    elif seed % 200 == 11:
        data = jpeg(pixels, mode="CMYK")
    else:
        data = jpeg(pixels)
    with open(path, "wb") as f:
        f.write(data)


def write_tree(root: str, train: int, val: int) -> None:
    tasks = []
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            folder = os.path.join(root, split, f"class{i % CLASSES}")
            os.makedirs(folder, exist_ok=True)
            tasks.append(
                (os.path.join(folder, f"{i:06d}.jpg"), i + (10**6 if split == "val" else 0))
            )
    with concurrent.futures.ProcessPoolExecutor() as pool:
        list(pool.map(_file, tasks, chunksize=64))


def plain(args: argparse.Namespace) -> float:
    from gpu_throughput import plain_torch

    ns = argparse.Namespace(
        device=args.device, image_size=args.image_size, batch=args.batch, steps=args.plain_steps
    )
    import gpu_throughput

    gpu_throughput.MODEL = MODELS[args.model]
    return plain_torch(ns)


def ftjob(args: argparse.Namespace, dataset: str, path: str, decode_in: str) -> tuple[float, str]:
    from ftjob.config import JobConfig, TrainerConfig
    from ftjob.driver import runner

    gpu = args.device == "cuda"
    cores = os.cpu_count() or 2
    job = JobConfig(
        model=dict(MODELS[args.model]),
        optimizer={"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9},
        dataset={
            "_target_": f"ftjob.datasets.{'ParquetDataset' if dataset == 'parquet' else 'ImageFolderDataset'}",
            "path": path,
            "image_size": args.image_size,
            "resize_size": args.resize,
        },
        trainer=TrainerConfig(
            num_workers=1,
            use_gpu=gpu,
            resources_per_worker={"CPU": float(max(1, cores - 2)), **({"GPU": 1.0} if gpu else {})},
            epochs=args.epochs,
            batch_size=args.batch,
            lr=0.1,
            lr_schedule="constant",
            precision="bf16" if gpu else "fp32",
            channels_last=True,
            prefetch_batches=4,
            log_every_n_steps=50,
            decode_in=decode_in,
        ),
    )
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
    if not result.ok:
        raise RuntimeError(f"ftjob run failed: {result.error}")
    timing, m = result.summary["timing"], result.summary["metrics"]
    steps = max(m[M.TRAIN_STEPS_COMPLETED], 1)
    where = ", ".join(f"{k.split('/')[1]} {m[k] * 1000 / steps:.1f}" for k in STAGES)
    fallbacks = {k.split("_", 1)[1]: int(m[k]) for k in M.DATA_FALLBACKS if m[k]}
    rate = (m[M.TRAIN_ROWS_PROCESSED] - args.batch) / (timing["finished"] - timing["first_step"])
    return rate, f"ms a step: {where}; fallbacks {fallbacks or 'none'}"


def ray_data_loop(args: argparse.Namespace, path: str) -> float:
    import ray
    import ray.train
    from handwritten import gpu_loop, jpeg_train
    from ray.train.torch import TorchTrainer

    gpu = args.device == "cuda"
    cores = os.cpu_count() or 2
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        _, dataset, norm = jpeg_train(path, args.image_size, args.resize)
        with tempfile.TemporaryDirectory() as storage:
            result_file = os.path.join(storage, "rate.json")
            TorchTrainer(
                gpu_loop,
                train_loop_config={
                    "model": MODELS[args.model],
                    "classes": CLASSES,
                    "norm": norm,
                    "epochs": args.epochs,
                    "batch": args.batch,
                    "result_file": result_file,
                },
                scaling_config=ray.train.ScalingConfig(
                    num_workers=1, use_gpu=gpu, resources_per_worker={"CPU": 1}
                ),
                run_config=ray.train.RunConfig(storage_path=storage, name="raydata"),
                datasets={"train": dataset},
            ).fit()
            with open(result_file) as f:
                done = json.load(f)
    finally:
        ray.shutdown()
    return done["rows"] / max(done["seconds"], 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=16384)
    parser.add_argument("--val", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--plain-steps", type=int, default=100)
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ftjob.data.to_parquet import convert

    work = tempfile.mkdtemp(prefix="ftjob-gpu-input-")
    tree, shards = os.path.join(work, "tree"), os.path.join(work, "shards")
    start = time.perf_counter()
    write_tree(tree, args.train, args.val)
    convert(tree, shards, 1024, rows_per_group=128)
    print(
        f"{args.train} + {args.val} JPEGs and their Parquet shards in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    rates: dict[str, float] = {}
    runs = {
        "plain torch": lambda: (plain(args), "batches already on the device"),
        "ftjob device folder": lambda: ftjob(args, "imagefolder", tree, "device"),
        "ftjob device parquet": lambda: ftjob(args, "parquet", shards, "device"),
        "ftjob worker folder": lambda: ftjob(args, "imagefolder", tree, "worker"),
        "ray data loop": lambda: (ray_data_loop(args, tree), "Ray Data decodes on the CPUs"),
    }
    for name, run in runs.items():
        try:
            rates[name], said = run()
        except Exception as exc:  # noqa: BLE001 -- one part's failure is reported, the rest run
            print(f"{name:<22} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        print(f"{name:<22} {rates[name]:9.1f} images/s  ({said})", flush=True)
    for name in ("ftjob device folder", "ftjob device parquet"):
        for base, target in (("plain torch", 0.9), ("ray data loop", 2.0)):
            if name in rates and base in rates:
                ratio = rates[name] / rates[base]
                verdict = "meets" if ratio >= target else "MISSES"
                print(f"{name} / {base} = {ratio:.3f} ({verdict} the target {target})")


if __name__ == "__main__":
    main()
