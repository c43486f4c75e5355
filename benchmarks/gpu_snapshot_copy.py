"""A memory-tier snapshot's stall on a GPU: a ResNet-50 state with SGD momentum (~180 MB, ~480
tensors) copied from the device into host memory shaped like the holder's ring (a shared
memory file, mapped), side by side in one run:

  per tensor   one ``copy_`` a tensor (the tier's copy before it gathered on the device);
  gathered     :func:`ftjob.storage.memory.format.copy_from_devices`: runs of one dtype gathered
               on the device, one copy to the host a run, into pageable memory (the tier where
               the driver refuses to page-lock the ring);
  registered   the same into the mapping page-locked with ``cudaHostRegister`` (the copy engine
               writes it directly): what the tier does on a GPU (``Ring.page_lock``);
  pinned       the same into memory from torch's pinned allocator: the bound.

Milliseconds per snapshot (median of ``--repeats`` after two warm-ups) and the ratios to the
per-tensor copy. Needs CUDA.

    python benchmarks/gpu_snapshot_copy.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torchvision

from ftjob.storage.memory.format import Flat, copy_from_devices


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
    args = parser.parse_args()
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

    results = {"per tensor": timed(per_tensor(ring), args.repeats)}
    expected = ring.clone()
    ring.zero_()
    results["gathered"] = timed(lambda: copy_from_devices(ring, offsets, tensors), args.repeats)
    assert torch.equal(ring, expected), "the gathered copy differs"
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ring.data_ptr(), size, 0)
    if err == cudart.cudaError.success:
        ring.zero_()
        results["registered"] = timed(
            lambda: copy_from_devices(ring, offsets, tensors), args.repeats
        )
        assert torch.equal(ring, expected), "the registered copy differs"
        cudart.cudaHostUnregister(ring.data_ptr())
    else:
        print(f"cudaHostRegister refused: {err}", flush=True)
    pinned = torch.zeros(size, dtype=torch.uint8).pin_memory()
    results["pinned"] = timed(lambda: copy_from_devices(pinned, offsets, tensors), args.repeats)
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
