"""GPU throughput: ResNet-50 on synthetic 224x224 images, plain torch vs ftjob (1 worker).

  plain torch: one process, a fixed pool of batches already on the GPU (bf16 autocast,
               channels_last) -- the model's compute-bound ceiling, no data pipeline at all;
  ftjob:       the full runner with use_gpu, bf16, channels_last, pinned memory, the same
               synthetic images made where --decode-in says (default device: on the GPU, so the
               data path is the only thing between ftjob and the GPU; ray: Ray Data on the
               CPUs, as measured before), checkpoints and validation at the end of each epoch.
Images/s after the first step; runs interleaved; prints medians and ``ftjob/plain = X``.

    python benchmarks/gpu_throughput.py [--repeats 2] [--steps 150] [--batch 128]
    python benchmarks/gpu_throughput.py --device cpu --image-size 32 --steps 6 --batch 8   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from ftjob.worker.models import build_model

MODEL = {"_target_": "torchvision.models.resnet50", "weights": None}
CLASSES = 1000


def plain_torch(args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(MODEL, CLASSES).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    size, b = args.image_size, args.batch
    pool = [
        (
            torch.randn(b, 3, size, size, device=device).contiguous(
                memory_format=torch.channels_last
            ),
            torch.randint(0, CLASSES, (b,), device=device),
        )
        for _ in range(4)
    ]
    start, rows = None, 0
    for step in range(args.steps):
        images, labels = pool[step % len(pool)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if start is None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        else:
            rows += b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return rows / (time.perf_counter() - start)


def ftjob(args: argparse.Namespace) -> float:
    from ftjob.config import JobConfig, TrainerConfig
    from ftjob.driver import runner

    gpu = args.device == "cuda"
    cpus = max(1, (os.cpu_count() or 2) - 2)
    job = JobConfig(
        model=dict(MODEL),
        optimizer={"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9},
        dataset={
            "_target_": "ftjob.datasets.SyntheticDataset",
            "num_samples": args.batch * args.steps,
            "num_val_samples": args.batch * 2,
            "image_size": args.image_size,
            "num_classes": CLASSES,
        },
        trainer=TrainerConfig(
            num_workers=1,
            use_gpu=gpu,
            resources_per_worker={"CPU": 2.0, "GPU": 1.0} if gpu else {"CPU": 1.0},
            epochs=1,
            batch_size=args.batch,
            lr=0.1,
            lr_schedule="constant",
            precision="bf16" if gpu else "fp32",
            channels_last=True,
            prefetch_batches=4,
            log_every_n_steps=50,
            decode_in=args.decode_in,
        ),
    )
    job.ray.num_cpus = cpus + 2
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)  # the run's record as its users read it
    if not result.ok:
        raise RuntimeError(f"ftjob run failed: {result.error}")
    timing, metrics = summary["timing"], summary["metrics"]
    return (metrics["train/rows_processed"] - args.batch) / (
        timing["finished"] - timing["first_step"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode-in", default="device", help="ftjob's trainer.decode_in")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results: dict[str, list[float]] = {"plain torch": [], "ftjob": []}
    for r in range(args.repeats):
        for name, fn in (("plain torch", plain_torch), ("ftjob", ftjob)):
            value = fn(args)
            results[name].append(value)
            print(f"[repeat {r + 1}/{args.repeats}] {name:<12} {value:9.1f} images/s", flush=True)
    plain, ours = statistics.median(results["plain torch"]), statistics.median(results["ftjob"])
    print(
        f"resnet50 {args.image_size}px batch {args.batch} on {args.device}: plain torch {plain:.1f} images/s, ftjob {ours:.1f} images/s"
    )
    print(f"ftjob/plain = {ours / plain:.3f}")


if __name__ == "__main__":
    main()
