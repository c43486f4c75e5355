"""Exact mode (``trainer.exact=true``) against data parallel mode: the same training step,
the same world size, the same micro-batches, side by side in one run.

Two processes in a gloo group (one torch thread each, as a 1-CPU Ray Train worker), each
training its half of every global batch: data parallel mode is DDP over ``MicroBatchBackward``
(what ``Worker`` builds by default), exact mode ``ExactBackward`` on the bare model; both step
SGD with momentum. The modes alternate in rounds of ``--steps`` steps after a warm-up; prints
images/s (medians of the rounds), ``exact/normal``, and the bytes each rank puts on the wire
per step: DDP's float32 gradients against exact mode's float64 sums with their per-tensor
counters, and the buffers' int64 bit patterns.

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


def wire_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes a rank sends into the step's all-reduces: DDP (float32 gradients), exact mode
    (float64 gradient sums and five float64 counters a tensor, int64 buffer bits)."""
    from ftjob.worker.exact_sum import FLAGS

    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    buffers = sum(b.numel() for b in model.buffers())
    return 4 * n, 8 * n + 8 * buffers + 8 * FLAGS * len(params)


def rank_main(rank: int, port: int, job: Job, rounds: int, steps: int, out: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from ftjob.worker.backward import MicroBatchBackward
    from ftjob.worker.exact import ExactBackward

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
    for mode in ("normal", "exact"):
        torch.manual_seed(0)
        model = job.model()
        if mode == "normal":
            wrapped: Any = DistributedDataParallel(model)
            backward: Any = MicroBatchBackward(job.micro_batch)
        else:
            wrapped, backward = model, ExactBackward(rank, WORLD, job.micro_batch, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        modes[mode] = (wrapped, backward, optimizer)

    def step(mode: str, index: int) -> None:
        wrapped, backward, optimizer = modes[mode]
        optimizer.zero_grad(set_to_none=True)
        backward(index, wrapped, batch, lambda x, y: F.cross_entropy(wrapped(x), y), lambda: None)
        optimizer.step()

    rates: dict[str, list[float]] = {"normal": [], "exact": []}
    for mode in modes:  # warm-up
        for i in range(3):
            step(mode, i)
    for r in range(rounds):
        for mode in ("normal", "exact") if r % 2 == 0 else ("exact", "normal"):
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                step(mode, i)
            dist.barrier()
            rates[mode].append(job.global_batch * steps / (time.perf_counter() - start))
    if rank == 0:
        out.put((rates, wire_bytes(modes["exact"][0])))
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
        "| job | global batch / micro | normal | exact | exact/normal | wire/step/rank normal | exact | extra |"
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
        rates, (normal_bytes, exact_bytes) = out.get()
        for p in procs:
            p.join()
        normal, exact = statistics.median(rates["normal"]), statistics.median(rates["exact"])
        mb = 2**20
        print(
            f"| {name} | {job.global_batch} / {job.micro_batch} | {normal:.0f} | {exact:.0f} | "
            f"{exact / normal:.3f} | {normal_bytes / mb:.2f} MiB | {exact_bytes / mb:.2f} MiB | "
            f"+{(exact_bytes - normal_bytes) / mb:.2f} MiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
