"""Exact mode (``trainer.exact=true``) against data parallel mode: the same training step,
the same world size, the same micro-batches, side by side in one run.

Two processes in a gloo group (one torch thread each, as a 1-CPU Ray Train worker), each
training its half of every global batch: data parallel mode (``normal``) is DDP over
``MicroBatchBackward`` (what ``Worker`` builds by default), exact mode ``ExactBackward`` on the
bare model -- ``exact`` with the sum the product picks (the tree where ``G`` is a power of two,
as in every job here), ``grid`` with the grid's sum that any other ``G`` takes; all step SGD
with momentum. The modes take turns in rounds of ``--steps`` steps after a warm-up; prints
images/s (medians of the rounds), ``exact/normal`` and ``grid/normal``, and the bytes each rank
puts into the step's all-reduces: DDP's float32 gradients; the tree's float32 sums; the grid's
float64 sums with their per-tensor counters; both exact sums with the buffers' int64 bits.

Jobs: ``digits`` (small_cnn, 32-pixel images, digits' shape) and ``resnet18`` (torchvision's
ResNet-18 on 32-pixel images); ``resnet18_64``, not run by default, is the same ResNet-18 on
64-pixel images (four times the pixels, the same sum). Random images: the step's
cost does not depend on the values.

    python benchmarks/exact_mode.py [--jobs digits,resnet18,resnet18_64] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2
MODES = ["normal", "exact", "grid"]


@dataclass(frozen=True)
class Job:
    name: str
    global_batch: int
    micro_batch: int
    image_size: int

    def model(self) -> torch.nn.Module:
        if self.name == "digits":
            from ftjob.models import SmallCNN

            return SmallCNN(10)
        import torchvision

        return torchvision.models.resnet18(num_classes=10)


JOBS = {
    "digits": Job("digits", global_batch=64, micro_batch=32, image_size=32),
    "resnet18": Job("resnet18", global_batch=64, micro_batch=16, image_size=32),
    "resnet18_64": Job("resnet18_64", global_batch=64, micro_batch=16, image_size=64),
}


@dataclass
class FakeBatch:
    images: torch.Tensor
    labels: torch.Tensor

    def keep(self) -> None:
        return None


def wire_bytes(model: torch.nn.Module, total: int, tree: bool) -> int:
    """Bytes a rank puts into one step's all-reduces in exact mode: the gradient sums (in the
    tree, a power-of-two ``total``: float32 at each of its log2(WORLD) levels; on the grid:
    float64 and five float64 counters a tensor) and the buffers' int64 bits."""
    from ftjob.worker.exact_sum import FLAGS, is_tree

    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    buffers = sum(b.numel() for b in model.buffers())
    if tree and is_tree(total):
        return 4 * n * (WORLD.bit_length() - 1) + 8 * buffers
    return 8 * n + 8 * FLAGS * len(params) + 8 * buffers


def ddp_bytes(model: torch.nn.Module) -> int:
    """DDP's: float32 gradients."""
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def rank_main(rank: int, port: int, job: Job, rounds: int, steps: int, out: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from ftjob.worker.backward import MicroBatchBackward
    from ftjob.worker.exact import ExactBackward
    from ftjob.worker.exact_sum import Workspace

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    torch.manual_seed(0)
    share = job.global_batch // WORLD
    batch = FakeBatch(
        torch.randn(share, 3, job.image_size, job.image_size), torch.randint(0, 10, (share,))
    )
    modes = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = job.model()
        if mode == "normal":
            wrapped: Any = DistributedDataParallel(model)
            backward: Any = MicroBatchBackward(job.micro_batch)
        else:  # exact: the sum the product picks for this G; grid: the grid's at any G
            work = Workspace(tree=mode == "exact")
            wrapped = model
            backward = ExactBackward(rank, WORLD, job.micro_batch, seed=0, work=work)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        modes[mode] = (wrapped, backward, optimizer)

    def step(mode: str, index: int) -> None:
        wrapped, backward, optimizer = modes[mode]
        optimizer.zero_grad(set_to_none=True)
        backward(index, wrapped, batch, lambda x, y: F.cross_entropy(wrapped(x), y), lambda: None)
        optimizer.step()

    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in modes:  # warm-up
        for i in range(3):
            step(mode, i)
    for r in range(rounds):
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:  # each goes first in turn
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                step(mode, i)
            dist.barrier()
            rates[mode].append(job.global_batch * steps / (time.perf_counter() - start))
    if rank == 0:
        model, total = modes["exact"][0], job.global_batch // job.micro_batch
        wire = {
            "normal": ddp_bytes(model),
            "exact": wire_bytes(model, total, tree=True),
            "grid": wire_bytes(model, total, tree=False),
        }
        out.put((rates, wire))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="digits,resnet18")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    print(f"world {WORLD}, gloo, 1 torch thread a rank; images/s, medians of {args.rounds} rounds")
    print(
        "| job | global batch / micro | normal | exact | grid | exact/normal | grid/normal "
        "| wire/step/rank normal / exact / grid |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.jobs.split(","):
        job = JOBS[name]
        out, port = ctx.Queue(), free_port()
        procs = [
            ctx.Process(target=rank_main, args=(r, port, job, args.rounds, args.steps, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        rates, wire = out.get()
        for p in procs:
            p.join()
        rate = {mode: statistics.median(rates[mode]) for mode in MODES}
        mb = 2**20
        print(
            f"| {name} | {job.global_batch} / {job.micro_batch} | {rate['normal']:.0f} | "
            f"{rate['exact']:.0f} | {rate['grid']:.0f} | {rate['exact'] / rate['normal']:.3f} | "
            f"{rate['grid'] / rate['normal']:.3f} | "
            + " / ".join(f"{wire[mode] / mb:.2f}" for mode in MODES)
            + " MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
