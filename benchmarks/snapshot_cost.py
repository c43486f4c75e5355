"""What one memory-tier snapshot costs, taken apart: digits' training state (small_cnn + Adam,
~1.1 MB) sent to the run's holder (a Ray actor on embedded Ray, as in a run), one torch thread
as in a Ray Train worker. Prints per-phase milliseconds (wall and this process's CPU), then
whole snapshots both ways a rank hands them to the holder (sent through Ray; written into the
holder's shared-memory ring): this process's CPU and the holder's (from /proc).

    python benchmarks/snapshot_cost.py [--snapshots 200]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from ftjob import metrics as M
from ftjob.config import MemoryConfig
from ftjob.models import SmallCNN
from ftjob.storage.memory import Flat, Snapshot, pack, start_holder
from ftjob.worker.snapshots import MemoryTier


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase(name: str, n: int, fn: Callable[[], Any]) -> Any:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        result = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name:<26} wall {1e3 * wall / n:6.2f} ms   cpu {1e3 * cpu / n:6.2f} ms")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshots", type=int, default=200)
    n = parser.parse_args().snapshots
    torch.set_num_threads(1)
    model = SmallCNN(num_classes=10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()  # Adam's moments exist: the state a resumed run needs
    records = {"state.json": {"step": 1}, "config.json": {}}

    def state() -> dict[str, Any]:
        return {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        holder = start_holder(2048, 2)
        holder_pid = ray.get(holder.__ray_call__.remote(lambda self: os.getpid()))
        flats = phase(
            "state dicts + copy", n, lambda: {k: Flat.copy_of(v) for k, v in state().items()}
        )
        phase("finiteness check", n, lambda: all(f.all_finite() for f in flats.values()))
        files = phase("pack", n, lambda: pack(flats, records))
        snapshot = phase("digests", n, lambda: Snapshot.of(1, files))
        phase("actor call with it", n, lambda: ray.get(holder.put.remote(snapshot)))
        phase("actor call, no argument", n, lambda: ray.get(holder.steps.remote()))
        same_size = np.zeros(snapshot.nbytes, np.uint8)
        phase("ray.put of as many bytes", n, lambda: ray.put(same_size))

        # Whole snapshots, both ways a rank hands them over: sent through Ray (a rank on
        # another machine than the holder's) and written into the holder's ring (its machine).
        costs = {}
        for channel in ("sent", "ring"):
            tier = MemoryTier(holder, MemoryConfig(enabled=True), 0, M.MetricSet(), ray.get, print)
            if channel == "sent":
                tier.ring = False  # as where the ring cannot be mapped
            tier.take(0, state(), lambda: records)  # the ring is made with the first one
            tier.wait()
            held, cpu, wall = cpu_seconds(holder_pid), time.process_time(), time.perf_counter()
            for step in range(1, n + 1):
                tier.take(step, state(), lambda: records)
                tier.wait()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            held = cpu_seconds(holder_pid) - held
            costs[channel] = cpu + held
            print(
                f"whole snapshot, {channel} ({snapshot.nbytes / 2**20:.2f} MB): wall "
                f"{1e3 * wall / n:.2f} ms, worker cpu {1e3 * cpu / n:.2f} ms, holder cpu "
                f"{1e3 * held / n:.2f} ms"
            )
        print(f"snapshot cpu ring/sent = {costs['ring'] / costs['sent']:.2f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
