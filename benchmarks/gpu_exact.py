"""Exact mode (``trainer.exact=true``) on a GPU: the same weights and buffers at world 1 and
world 2, bit for bit, and from run to run; data parallel mode beside it; step times of both.

Each rank runs the worker's training step as ``Worker`` builds it -- the model seeded alike on
every rank, the step's seed per rank, ``ExactBackward`` on the bare model in exact mode (after
``pin_kernels``, which asks a GPU for deterministic kernels: what the product sets with
``trainer.exact=true trainer.use_gpu=true``), DDP over ``MicroBatchBackward`` otherwise -- on
its contiguous share of a global batch of 64 synthetic images in micro-batches of 16, SGD
with momentum. It needs torch and torchvision alone (no Ray, Hydra or Ray Data), so it runs
wherever PyTorch does; the whole ``Worker`` (data, checkpoints, the memory tier) is tested in
process on CPU (tests/worker/test_exact.py).

World 2 on one GPU is two processes sharing it in a gloo process group, as the in-process
harness runs ranks: NCCL refuses two ranks on one device, and gloo all-reduces CUDA tensors
through host memory. So world 2's step times show two ranks sharing a GPU and gloo's copies,
not a 2-GPU job; the bits are what a 2-GPU run computes, for every micro-batch runs the same
kernels on the same shapes wherever it lands.

Jobs (each a model with BatchNorm and dropout): ``small_cnn`` (the tests' CNN, dropout 0.3)
and ``resnet18`` (torchvision's, 32-pixel images, dropout 0.2 before its last layer). Each
mode runs at world 1 and world 2 in processes of its own (torch's determinism settings are
per process), each job twice there (runs A and B) from the same seed.

Prints one line per comparison -- bit-identical, or how many tensors differ and by how much
-- and one per job and world size with the median step time of each mode and exact/normal
(the modes run one after the other: a comparison on a machine nothing else loads).
Exits non-zero only when exact mode is not bit-identical (or could not run).

    PYTHONPATH=. python3 benchmarks/gpu_exact.py                 # a CUDA device
    PYTHONPATH=. python3 benchmarks/gpu_exact.py --device cpu    # the same on CPU
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ftjob.worker.backward import MicroBatchBackward
from ftjob.worker.exact import ExactBackward, pin_kernels, refused_op
from ftjob.worker.models import SmallCNN

GLOBAL_BATCH = 64
MICRO_BATCH = 16
SEED = 7
CLASSES = 10
MODES = ("exact", "normal")
WORLDS = (1, 2)
RUNS = ("A", "B")


@dataclass(frozen=True)
class Job:
    name: str
    image_size: int
    steps: int

    def model(self) -> nn.Module:
        if self.name == "small_cnn":
            return SmallCNN(CLASSES, width=16, dropout=0.3)
        import torchvision

        model = torchvision.models.resnet18(num_classes=CLASSES)
        model.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(512, CLASSES))
        return model


JOBS = {"small_cnn": Job("small_cnn", 32, 16), "resnet18": Job("resnet18", 32, 12)}


@dataclass(frozen=True)
class StepBatch:
    """What the step reads of a batch (``ftjob.data.streams.Batch``): no skipped files."""

    images: torch.Tensor
    labels: torch.Tensor

    def keep(self) -> None:
        return None


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, drawn on the CPU: the same on every rank and in every run."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    images = torch.randn(GLOBAL_BATCH, 3, size, size, generator=g)
    return images, torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)


def step_seed(step: int, rank: int) -> int:
    """The worker's seed for a step's local randomness (``ftjob.worker.loop._step_seed``)."""
    return int(np.random.SeedSequence([SEED, step, rank]).generate_state(1)[0])


def settings() -> str:
    cudnn = torch.backends.cudnn
    return (
        f"deterministic algorithms {torch.are_deterministic_algorithms_enabled()} "
        f"(warn only {torch.is_deterministic_algorithms_warn_only_enabled()}), "
        f"cuDNN deterministic {cudnn.deterministic}, benchmark {cudnn.benchmark}, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}"
    )


def train(job: Job, mode: str, rank: int, world: int, device: torch.device) -> tuple[Any, list]:
    """One run of ``job``: the final state dict (rank 0's, on the CPU) and the step times."""
    torch.manual_seed(SEED)  # the same initial weights on every rank
    model = job.model().to(device)
    backward: Any
    if mode == "exact":
        wrapped, backward = model, ExactBackward(rank, world, MICRO_BATCH, SEED)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model) if world > 1 else model
        backward = MicroBatchBackward(MICRO_BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    share = GLOBAL_BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    times = []
    for step in range(job.steps):
        images, labels = global_batch(step, job.image_size)
        batch = StepBatch(images[rows].to(device), labels[rows].to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.manual_seed(step_seed(step, rank))
        optimizer.zero_grad(set_to_none=True)
        backward(step, wrapped, batch, lambda x, y: F.cross_entropy(wrapped(x), y), lambda: None)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return state, times


PROBES = {
    "interpolate(bilinear) backward": lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"),
    "AdaptiveAvgPool2d(2) backward": lambda x: F.adaptive_avg_pool2d(x, 2),
    "AdaptiveAvgPool2d(1) backward": lambda x: F.adaptive_avg_pool2d(x, 1),
    "ReflectionPad2d backward": lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"),
    "MaxPool2d backward": lambda x: F.max_pool2d(x, 2),
    "cross_entropy(label_smoothing) backward": lambda x: F.cross_entropy(
        x.flatten(1),
        torch.zeros(x.shape[0], dtype=torch.long, device=x.device),
        label_smoothing=0.1,
    ),
}


def probe_refusals(device: torch.device) -> list[str]:
    """Which common ops exact mode's settings refuse on this device (each a forward and a
    backward pass), and the fatal error the worker makes of a refusal."""
    found = []
    for name, op in PROBES.items():
        x = torch.randn(2, 3, 8, 8, device=device, requires_grad=True)
        try:
            op(x).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            found.append(f"{name}: runs")
        except RuntimeError as exc:
            found.append(f"{name}: REFUSED -> {refused_op(exc) or exc}")
    return found


def rank_main(
    rank: int, world: int, port: int, mode: str, args: argparse.Namespace, out: Any
) -> None:
    try:
        device = torch.device(args.device)
        if device.type == "cuda":  # both ranks of world 2 on the one device
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        if mode == "exact":  # before the process's first cuBLAS call
            pin_kernels(SimpleNamespace(exact=True, worker_cpus=args.threads), device)
        else:
            torch.set_num_threads(args.threads)
        if world > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=120),
            )
        times: dict[str, list[float]] = {}
        for name in args.jobs.split(","):
            for run in RUNS:
                state, took = train(JOBS[name], mode, rank, world, device)
                times[f"{name}-{run}"] = took
                if rank == 0:
                    torch.save(state, Path(args.scratch) / f"{name}-{mode}-{world}-{run}.pt")
        said = settings()
        if mode == "exact" and world == 1 and device.type == "cuda":
            said += "\n  " + "\n  ".join(probe_refusals(device))
        out.put((rank, None, times, said))
        if world > 1:
            dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), {}, ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, world: int, args: argparse.Namespace) -> tuple[str | None, dict, str]:
    """Mode ``mode`` at ``world``: each rank a process; rank 0's step times and settings, or
    the first error."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, mode, args, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + args.timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, error, times, said = out.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (0, None) for p in procs):
                break
            continue
        results[rank] = (error, times, said)
        if error:
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [e for e, _, _ in results.values() if e]
    if errors:
        return errors[0], {}, ""
    if len(results) < world:
        return f"ranks {sorted(set(range(world)) - set(results))} ended without a word", {}, ""
    return None, results[0][1], results[0][2]


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    if not differing:
        return f"bit-identical ({len(a)} tensors, weights and buffers)"
    floats = [k for k in differing if a[k].is_floating_point()]
    largest = max((float((a[k] - b[k]).abs().max()) for k in floats), default=0.0)
    counts = len(differing) - len(floats)  # BatchNorm's num_batches_tracked: micro-batches seen
    return (
        f"DIFFER in {len(differing)} of {len(a)} tensors ({counts} counts), largest "
        f"|difference| of a float {largest:.3g}"
    )


def compare_runs(scratch: Path, name: str, mode: str) -> bool:
    """Prints the comparisons of ``name``'s runs in ``mode``; whether all were bit-identical."""

    def state(world: int, run: str) -> Any:
        path = scratch / f"{name}-{mode}-{world}-{run}.pt"
        return torch.load(path, weights_only=True) if path.exists() else None

    pairs = [
        ("world 1 vs world 2", state(1, "A"), state(2, "A")),
        ("world 1, run A vs run B", state(1, "A"), state(1, "B")),
        ("world 2, run A vs run B", state(2, "A"), state(2, "B")),
    ]
    same = True
    for what, a, b in pairs:
        said = compare(a, b) if a is not None and b is not None else "NOT RUN"
        print(f"{name:9} {mode:6} {what}: {said}")
        same &= said.startswith("bit-identical")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the default) or cpu")
    parser.add_argument("--jobs", default="small_cnn,resnet18")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    parser.add_argument("--timeout", type=float, default=100.0, help="seconds a launch")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: --device cpu runs the same on the CPU")
        return 2
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    cudnn = torch.backends.cudnn.version() if args.device.startswith("cuda") else None
    print(
        f"{where}, torch {torch.__version__}, cuDNN {cudnn}, TF32 matmul "
        f"{torch.backends.cuda.matmul.allow_tf32} conv {torch.backends.cudnn.allow_tf32}; "
        f"global batch {GLOBAL_BATCH} in micro-batches of {MICRO_BATCH}, {args.threads} "
        "torch thread(s) a rank, world 2 = two processes on one device, gloo"
    )
    failed = False
    times: dict[tuple[str, int], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        args.scratch = scratch
        for mode in MODES:
            for world in WORLDS:
                started = time.perf_counter()
                error, times[(mode, world)], said = launch(mode, world, args)
                took = time.perf_counter() - started
                if error:
                    print(f"{mode} mode at world {world} FAILED ({took:.0f} s):\n{error}")
                    failed |= mode == "exact"
                    continue
                print(f"{mode} mode at world {world}: ran in {took:.0f} s; {said}")
        for name in args.jobs.split(","):
            for mode in MODES:
                failed |= not compare_runs(Path(scratch), name, mode) and mode == "exact"
        for name in args.jobs.split(","):
            for world in WORLDS:
                median = {}
                for mode in MODES:
                    runs = [times[(mode, world)].get(f"{name}-{run}", [])[2:] for run in RUNS]
                    steps = [t for r in runs for t in r]
                    median[mode] = statistics.median(steps) if steps else float("nan")
                e, n = median["exact"], median["normal"]
                print(
                    f"{name:9} step time at world {world}: exact {e * 1e3:.1f} ms, normal "
                    f"{n * 1e3:.1f} ms, exact/normal {e / n:.2f} (medians after 2 warm-up steps)"
                )
    print("exact mode: NOT bit-identical" if failed else "exact mode: bit-identical throughout")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
