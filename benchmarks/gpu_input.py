"""The GPU input path, side by side on one machine: ResNet-50 at 224 px, bf16, channels_last,
one GPU worker.

  plain torch          batches already on the GPU (the limit: no data path at all)
  ftjob device folder  trainer.decode_in=device on a folder of ImageNet-like JPEGs made here
                       (400x350, ~110 KB, quality 90; 1 in 100 progressive, 1 in 200 CMYK),
                       --epochs of them (3): images/s, and the GPU memory its tensors held epoch
                       by epoch (the worker's gpu/memory_* keys: flat, or a leak)
  ftjob device parquet the same files as Parquet shards (ftjob's writer)
  ftjob worker folder  trainer.decode_in=worker: the worker's PIL pool on its reserved CPUs
  ray data loop        the seed benchmark's pipeline: a hand-written Ray Train loop with Ray
                       Data decoding the files on the CPUs (benchmarks/handwritten.py)
Before them: the device decode of one batch of these files, twice -- the same bytes give the same
pixels, or not (and how far from the PIL path's).

Targets: ftjob from the folder and from Parquet >= 0.9x plain torch and >= 2x the Ray Data loop,
each printed with PASS or FAIL; the GPU memory's growth between epochs <= 1 % of its peak.
ftjob's rate is its training loop's -- rows over its steps and the batch waits between them, as
plain torch's is its steps' --; its rate from the first step to the run's end (epoch ends'
validation and checkpoints in it) is printed beside. Each ftjob run's summary says where a step's
time went (data/read, copy, decode, augment, step). Each part prints as it ends, and --results
keeps every figure so far as JSON (a part cut short by a timeout leaves the ones before it).

The files are made once under --root (reused when it holds them: gpu_job.py trains on them too);
--unique of them are distinct pictures, the rest hard links to them under other names (a decoder
meets each file's bytes anew; making 8,000 pictures would take a minute of the machine).

    python benchmarks/gpu_input.py [--train 8192] [--epochs 3] [--batch 128] [--results in.json]
        [--runs plain,folder,parquet,worker,raydata]
    python benchmarks/gpu_input.py --device cpu --train 48 --val 8 --epochs 2 --batch 8 \\
        --model small_cnn --image-size 32 --resize 36 --plain-steps 5   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

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
TARGETS = {"plain torch": 0.9, "ray data loop": 2.0}  # ftjob from the folder and Parquet: >= this
MEMORY_GROWTH = 0.01  # the largest rise of an epoch's GPU peak, as a share of the peak
VAL_SEED = 10**6


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


def write_tree(root: str, train: int, val: int, unique: int = 2000) -> None:
    """``root/{train,val}/class<k>/NNNNNN.jpg``: training file ``i`` shows picture ``i %
    unique`` (a hard link to the first file of it), validation files are distinct."""
    made, links = [], []
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            folder = os.path.join(root, split, f"class{i % CLASSES}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{i:06d}.jpg")
            if split == "val":
                made.append((path, VAL_SEED + i))
            elif i < unique:
                made.append((path, i))
            else:
                links.append((path, made[i % unique][0]))
    with concurrent.futures.ProcessPoolExecutor() as pool:
        list(pool.map(_file, made, chunksize=16))
    for path, source in links:
        os.link(source, path)


def ensure_data(root: str, train: int, val: int) -> tuple[str, str]:
    """The JPEG tree and its Parquet shards under ``root``: made, or found made for these
    counts (a marker written last says so: a tree cut short by a timeout is made again)."""
    from ftjob.data.to_parquet import convert

    tree, shards = os.path.join(root, "tree"), os.path.join(root, "shards")
    marker, wanted = os.path.join(root, "made.json"), {"train": train, "val": val}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return tree, shards
    import shutil

    for folder in (tree, shards):
        shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    write_tree(tree, train, val)
    convert(tree, shards, 1024, rows_per_group=128)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    print(
        f"{train} + {val} JPEGs and their Parquet shards in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return tree, shards


def plain(args: argparse.Namespace) -> float:
    import gpu_throughput

    ns = argparse.Namespace(
        device=args.device, image_size=args.image_size, batch=args.batch, steps=args.plain_steps
    )
    gpu_throughput.MODEL = MODELS[args.model]
    return gpu_throughput.plain_torch(ns)


def job_config(args: argparse.Namespace, dataset: str, path: str, **trainer: Any) -> Any:
    """ftjob's job for this benchmark: one worker with the machine's cores but two."""
    from ftjob.config import JobConfig, TrainerConfig

    gpu = args.device == "cuda"
    cores = os.cpu_count() or 2
    settings: dict[str, Any] = dict(
        num_workers=1,
        use_gpu=gpu,
        resources_per_worker={"CPU": float(max(1, cores - 2)), **({"GPU": 1.0} if gpu else {})},
        batch_size=args.batch,
        lr=0.1,
        lr_schedule="constant",
        precision="bf16" if gpu else "fp32",
        channels_last=True,
        prefetch_batches=4,
        log_every_n_steps=50,
    )
    settings.update(trainer)
    return JobConfig(
        model=dict(MODELS[args.model]),
        optimizer={"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9},
        dataset={
            "_target_": f"ftjob.datasets.{'ParquetDataset' if dataset == 'parquet' else 'ImageFolderDataset'}",
            "path": path,
            "image_size": args.image_size,
            "resize_size": args.resize,
        },
        trainer=TrainerConfig(**settings),
    )


def loop_rate(metrics: dict[str, float]) -> float:
    """Images/s of the training loop: rows over its steps and the batch waits between them."""
    busy = metrics[M.TRAIN_STEP] + metrics[M.TRAIN_ITER_BATCH]
    return metrics[M.TRAIN_ROWS_PROCESSED] / max(busy, 1e-9)


def ftjob(args: argparse.Namespace, dataset: str, path: str, decode_in: str, epochs: int) -> dict:
    """One ftjob run; its rates, where a step's time went and its GPU memory figures."""
    from ftjob.driver import runner

    job = job_config(args, dataset, path, epochs=epochs, decode_in=decode_in)
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)  # the run's record as its users read it
    if not result.ok:
        raise RuntimeError(f"ftjob run failed: {result.error}")
    timing, m = summary["timing"], summary["metrics"]
    steps = max(m[M.TRAIN_STEPS_COMPLETED], 1)
    where = ", ".join(f"{k.split('/')[1]} {m[k] * 1000 / steps:.1f}" for k in STAGES)
    fallbacks = {k.split("_", 1)[1]: int(m[k]) for k in M.DATA_FALLBACKS if m[k]}
    wall = (m[M.TRAIN_ROWS_PROCESSED] - args.batch) / (timing["finished"] - timing["first_step"])
    memory = {k: m[k] for k in (M.GPU_MEMORY_EPOCH_PEAK, M.GPU_MEMORY_PEAK, M.GPU_MEMORY_GROWTH)}
    return {
        "rate": loop_rate(m),
        "wall_rate": wall,
        "said": f"{wall:.1f} from the first step to the end; ms a step: {where}; "
        f"fallbacks {fallbacks or 'none'}",
        "memory": memory,
    }


def ray_data_loop(args: argparse.Namespace, path: str) -> float:
    import ray
    import ray.train
    from handwritten import gpu_loop, jpeg_train
    from ray.train.torch import TorchTrainer

    gpu = args.device == "cuda"
    cores = os.cpu_count() or 2
    ray.init(  # a Ray of its own, as ftjob's runs start one: never a cluster found running here
        address="local",
        num_cpus=cores,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
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
                    "epochs": args.other_epochs,
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


def memory_verdict(memory: dict[str, float], epochs: int) -> str:
    peak, growth = memory[M.GPU_MEMORY_PEAK], memory[M.GPU_MEMORY_GROWTH]
    if not peak:
        return "GPU memory: not measured (no CUDA device)"
    verdict = "PASS" if growth <= MEMORY_GROWTH * peak else "FAIL"
    return (
        f"GPU memory over {epochs} epochs (ftjob device folder, rank 0, torch's allocated): "
        f"the last epoch's peak {memory[M.GPU_MEMORY_EPOCH_PEAK]:.0f} MiB, the highest "
        f"{peak:.0f} MiB, the largest rise between epochs {growth:.1f} MiB "
        f"({verdict}: <= {MEMORY_GROWTH:.0%} of the peak)"
    )


def verdicts(rates: dict[str, float]) -> list[str]:
    lines = []
    for name in ("ftjob device folder", "ftjob device parquet"):
        for base, target in TARGETS.items():
            if name in rates and base in rates:
                ratio = rates[name] / rates[base]
                verdict = "PASS" if ratio >= target else "FAIL"
                lines.append(f"{name} / {base} = {ratio:.3f} ({verdict}: >= {target})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="where the files are made (default: temp)")
    parser.add_argument("--train", type=int, default=8192)
    parser.add_argument("--val", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3, help="the device folder run's")
    parser.add_argument("--other-epochs", type=int, default=1, help="the other runs'")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--plain-steps", type=int, default=100)
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--results", default=None, help="JSON of every figure, kept as it goes")
    parser.add_argument(
        "--runs", default="plain,folder,parquet,worker,raydata", help="which runs, in order"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = args.root or tempfile.mkdtemp(prefix="ftjob-gpu-input-")
    tree, shards = ensure_data(root, args.train, args.val)
    results: dict[str, Any] = {"rates": {}, "wall_rates": {}, "verdicts": []}

    def keep() -> None:
        if args.results:
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)

    from gpu_decoders import deterministic

    results["deterministic"] = deterministic(args, tree)
    print(results["deterministic"], flush=True)
    keep()
    runs: dict[str, tuple[str, Callable[[], Any]]] = {
        "plain": ("plain torch", lambda: plain(args)),
        "folder": (
            "ftjob device folder",
            lambda: ftjob(args, "imagefolder", tree, "device", args.epochs),
        ),
        "parquet": (
            "ftjob device parquet",
            lambda: ftjob(args, "parquet", shards, "device", args.other_epochs),
        ),
        "worker": (
            "ftjob worker folder",
            lambda: ftjob(args, "imagefolder", tree, "worker", args.other_epochs),
        ),
        "raydata": ("ray data loop", lambda: ray_data_loop(args, tree)),
    }
    for key in args.runs.split(","):
        name, run = runs[key]
        try:
            done = run()
        except Exception as exc:  # noqa: BLE001 -- one part's failure is reported, the rest run
            print(f"{name:<22} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        if isinstance(done, dict):
            results["rates"][name], results["wall_rates"][name] = done["rate"], done["wall_rate"]
            print(f"{name:<22} {done['rate']:9.1f} images/s  ({done['said']})", flush=True)
            if name == "ftjob device folder":
                results["memory"] = done["memory"]
                print(memory_verdict(done["memory"], args.epochs), flush=True)
        else:
            results["rates"][name] = done
            print(f"{name:<22} {done:9.1f} images/s", flush=True)
        results["verdicts"] = verdicts(results["rates"])
        keep()
    for line in results["verdicts"]:
        print(line)
    if "memory" in results:
        results["verdicts"].append(memory_verdict(results["memory"], args.epochs))
        keep()


if __name__ == "__main__":
    main()
