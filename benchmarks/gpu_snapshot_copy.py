"""A memory-tier snapshot's stall on a GPU: a ResNet-50 state with SGD momentum (~180 MB, ~480
tensors) copied from the device into host memory shaped like the holder's ring (a shared
memory file, mapped), side by side in one run:

  per tensor   one ``copy_`` a tensor (the tier's copy before it gathered on the device);
  gathered     :func:`ftjob.memory.format.copy_from_devices`: runs of one dtype gathered
               on the device, one copy to the host a run, into pageable memory (the tier where
               the driver refuses to page-lock the ring);
  registered   the same into the mapping page-locked with ``cudaHostRegister`` (the copy engine
               writes it directly): what the tier does on a GPU (``Ring.page_lock``);
  pinned       the same into memory from torch's pinned allocator: the bound.

Milliseconds per snapshot (median of ``--repeats`` after two warm-ups) and the ratios to the
per-tensor copy. Needs CUDA.

Then (``--part tier``) the memory tier itself in a training loop: ResNet-50 at 224 px, batch 64,
bf16, channels_last, SGD with momentum, a snapshot after every step into a holder's ring in
this process (page-locked), the ways taking turns (:func:`snapshot_cost.blocking`): no tier;
the tier before its copy left the step (read from git's history: left out where the repository
has none); the copy waited for in ``take`` (the stream synchronised, as the copy into host
memory did before); the copy beside the next step -- the step's time, what the training thread
lost per snapshot (``take``, ``settle``'s wait, the device's wait measured by timing events)
against a step, and the interval ``every_n_steps=auto`` picks at its 2 %. Runs on
the CPU too with small sizes (``--device cpu --model resnet18 --image-size 32 --batch 4``: the
copy part needs CUDA and is left out there).

    python benchmarks/gpu_snapshot_copy.py [--repeats 10] [--part copy|tier|all]
        [--steps 10] [--rounds 3] [--model resnet50] [--image-size 224] [--batch 64]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torchvision

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # ftjob from the checkout; the sibling benchmark

from snapshot_cost import add_loop_arguments, blocking  # noqa: E402 -- a sibling benchmark

from ftjob.memory.format import Flat, copy_from_devices  # noqa: E402


def state() -> list[torch.Tensor]:
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 3, 64, 64, device="cuda")).sum().backward()
    opt.step()
    tensors = [*model.state_dict().values()]
    return tensors + [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's offset in the tier's flat buffer, and its size: Flat.copy_of's own."""
    flat = Flat.copy_of({"t": tensors})
    return [marker[1] for marker in flat.skeleton["t"]], flat.buffer.numel()


def timed(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for r in range(repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if r >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--part", choices=["copy", "tier", "all"], default="all")
    add_loop_arguments(parser, device="cuda" if torch.cuda.is_available() else "cpu")
    parser.set_defaults(
        model="resnet50",
        image_size=224,
        batch=64,
        steps=10,
        rounds=3,
        bf16=True,
        channels_last=True,
        threads=torch.get_num_threads(),
    )
    args = parser.parse_args()
    if args.part in ("copy", "all") and torch.device(args.device).type == "cuda":
        copies(args.repeats)
    if args.part in ("tier", "all"):
        blocking(args)


def copies(repeats: int) -> None:
    """The copy alone, four ways (the module's docstring)."""
    tensors = state()
    offsets, size = layout(tensors)
    fd = os.memfd_create("ftjob-bench")
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    ring = torch.from_numpy(np.frombuffer(mapping, np.uint8))
    print(
        f"{torch.cuda.get_device_name(0)}: {len(tensors)} tensors, {size / 2**20:.1f} MiB",
        flush=True,
    )

    def per_tensor(buffer: torch.Tensor) -> Callable[[], None]:
        views = [
            buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, tensors, strict=True)
        ]
        return lambda: [v.copy_(t) for v, t in zip(views, tensors, strict=True)] and None

    results = {"per tensor": timed(per_tensor(ring), repeats)}
    expected = ring.clone()
    ring.zero_()
    results["gathered"] = timed(lambda: copy_from_devices(ring, offsets, tensors), repeats)
    assert torch.equal(ring, expected), "the gathered copy differs"
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ring.data_ptr(), size, 0)
    if err == cudart.cudaError.success:
        ring.zero_()
        results["registered"] = timed(lambda: copy_from_devices(ring, offsets, tensors), repeats)
        assert torch.equal(ring, expected), "the registered copy differs"
        cudart.cudaHostUnregister(ring.data_ptr())
    else:
        print(f"cudaHostRegister refused: {err}", flush=True)
    pinned = torch.zeros(size, dtype=torch.uint8).pin_memory()
    results["pinned"] = timed(lambda: copy_from_devices(pinned, offsets, tensors), repeats)
    assert torch.equal(pinned, expected), "the pinned copy differs"
    torch.randn(4, device="cuda").sum().item()  # a kernel after it all: no stale CUDA error
    base = results["per tensor"]
    for name, ms in results.items():
        print(
            f"{name:<11} {ms:7.2f} ms  {size / 2**30 / (ms / 1e3):6.1f} GiB/s  "
            f"per tensor/{name} = {base / ms:.2f}"
        )


if __name__ == "__main__":
    main()
