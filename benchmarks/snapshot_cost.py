"""What one memory-tier snapshot costs, taken apart, side by side in one run.

1. ``digits``: digits' training state (small_cnn + Adam, ~1.1 MB) sent to the run's holder (a
   Ray actor on embedded Ray, as in a run), one torch thread as in a Ray Train worker. Prints
   per-phase milliseconds (wall and this process's CPU), then whole snapshots both ways a rank
   hands them to the holder (sent through Ray; written into the holder's shared-memory ring):
   this process's CPU and the holder's (from /proc).
2. ``checksums``: the snapshot checksum's candidates on 200 MB of tensor bytes (a ResNet-50
   state with momentum, packed): SHA-256 against XXH3-64/128 (xxhash), BLAKE3 and CRC32C
   (google-crc32c, crc32c) where installed; interleaved, medians; prints ``X/sha256``.
3. ``resnet50``: whole snapshots of ResNet-50 + SGD momentum (~200 MB) into a holder's ring on
   this machine, with the tier's checksum and with SHA-256, alternating: the time on the
   training thread (the copy), the background thread's wall and CPU, and the digest's share.

    python benchmarks/snapshot_cost.py [--snapshots 200] [--big-snapshots 10]
        [--only digits|checksums|resnet50]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
import torchvision
import xxhash

from ftjob import metrics as M
from ftjob.config import MemoryConfig
from ftjob.models import SmallCNN
from ftjob.storage.memory import (
    Flat,
    Snapshot,
    SnapshotHolder,
    digest_all,
    pack,
    start_holder,
    state_bytes,
)
from ftjob.storage.memory import format as fmt
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
    parser.add_argument("--big-snapshots", type=int, default=10)
    parser.add_argument("--only", choices=["digits", "checksums", "resnet50"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a Ray Train worker
    if args.only in (None, "digits"):
        digits(args.snapshots)
    if args.only in (None, "checksums", "resnet50"):
        flats = resnet50_flats()
        if args.only in (None, "checksums"):
            checksums(flats)
        if args.only in (None, "resnet50"):
            resnet50_snapshots(args.big_snapshots)


def digits(n: int) -> None:
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


def resnet50_state() -> dict[str, Any]:
    """torchvision's ResNet-50 and its SGD momentum (~200 MB): the state a resumed run needs."""
    model = torchvision.models.resnet50(num_classes=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # momentum buffers exist
    return {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}


def resnet50_flats() -> dict[str, Flat]:
    return {name: Flat.copy_of(state) for name, state in resnet50_state().items()}


def candidates() -> dict[str, Callable[[memoryview], Any]]:
    """Checksums to compare, by name: hashlib's SHA-256 and those of the libraries installed."""
    found: dict[str, Callable[[memoryview], Any]] = {
        "sha256": lambda view: hashlib.sha256(view).hexdigest(),
        "xxh3_64": xxhash.xxh3_64_hexdigest,
        "xxh3_128": xxhash.xxh3_128_hexdigest,
    }
    try:
        import blake3

        found["blake3"] = lambda view: blake3.blake3(view).hexdigest()
    except ImportError:
        print("blake3 not installed: left out")
    try:
        import crc32c

        found["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        print("crc32c not installed: left out")
    try:
        import google_crc32c

        found["crc32c (google-crc32c)"] = lambda view: google_crc32c.extend(0, view.toreadonly())
    except ImportError:
        print("google-crc32c not installed: left out")
    return found


def checksums(flats: dict[str, Flat], repeats: int = 5) -> None:
    """Each candidate over the state's tensor bytes (one view an array, as the tier digests
    them), interleaved: wall and CPU medians, GB/s, and each against SHA-256."""
    views = [memoryview(flat.buffer.numpy()) for flat in flats.values()]
    nbytes = sum(v.nbytes for v in views)
    print(f"\nchecksums over {nbytes / 2**20:.0f} MB of tensor bytes, {repeats} rounds:")
    found = candidates()
    walls: dict[str, list[float]] = {name: [] for name in found}
    cpus: dict[str, list[float]] = {name: [] for name in found}
    for name, fn in found.items():  # warm: first touches, lazy imports
        for view in views:
            try:
                fn(view)
            except TypeError as exc:  # a binding that takes only bytes: would need a copy
                print(f"{name}: {exc}: left out")
                walls.pop(name)
                break
    for _ in range(repeats):
        for name in walls:
            fn = found[name]
            cpu, wall = time.process_time(), time.perf_counter()
            for view in views:
                fn(view)
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    base = statistics.median(walls["sha256"])
    for name, runs in walls.items():
        wall, cpu = statistics.median(runs), statistics.median(cpus[name])
        print(
            f"  {name:<24} wall {1e3 * wall:7.1f} ms   cpu {1e3 * cpu:7.1f} ms   "
            f"{nbytes / wall / 1e9:5.1f} GB/s   {name}/sha256 = {wall / base:.3f}"
        )


class Direct:
    """A holder in this process behind the handle a rank uses (``holder.method.remote``)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        return type("Call", (), {"remote": staticmethod(getattr(self.target, name))})()


def resnet50_snapshots(n: int) -> None:
    """Whole snapshots into a ring on this machine, the tier's checksum and SHA-256 taking
    turns (a fresh tier each, one warm-up snapshot each): per-snapshot medians."""
    state = resnet50_state()
    records = {"state.json": {"step": 1}, "config.json": {}}
    files_mb = state_bytes(state) / 2**20
    print(f"\nResNet-50 + SGD momentum ({files_mb:.0f} MB), {n} snapshots a checksum, into a ring:")
    results: dict[str, dict[str, list[float]]] = {}
    tiers = {}
    for algorithm in (fmt.DIGEST, "sha256"):
        holder = Direct(SnapshotHolder(4 * 2**30, 2))
        tiers[algorithm] = MemoryTier(
            holder, MemoryConfig(enabled=True), 0, M.MetricSet(), lambda x: x, print
        )
        results[algorithm] = {"copy": [], "background wall": [], "background cpu": [], "digest": []}
    default = fmt.DIGEST
    try:
        for step in range(n + 1):
            for algorithm, tier in tiers.items():
                fmt.DIGEST = algorithm
                tier.take(step, state, lambda: records)
                copied = time.perf_counter()
                tier.wait()
                if step == 0:
                    continue  # the ring is made with the first one
                waited = time.perf_counter()
                r = results[algorithm]
                r["copy"].append(tier._copy_s)
                r["background wall"].append(waited - copied)
                r["background cpu"].append(tier._background_s or 0.0)
                held = tier.get(step)
                assert held is not None, "the snapshot did not verify"
                digest_start = time.thread_time()  # CPU, as the background's is
                digest_all(held.files)
                r["digest"].append(time.thread_time() - digest_start)
    finally:
        fmt.DIGEST = default
        for tier in tiers.values():
            tier.close(5.0)
    for algorithm, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        share = med["digest"] / (med["copy"] + med["background cpu"])
        print(
            f"  {algorithm:<9} training thread {1e3 * med['copy']:6.1f} ms   background wall "
            f"{1e3 * med['background wall']:6.1f} ms, cpu {1e3 * med['background cpu']:6.1f} ms"
            f"   digest cpu {1e3 * med['digest']:6.1f} ms ({100 * share:.0f} % of the snapshot's)"
        )
    mine, sha = (
        {k: statistics.median(v) for k, v in results[a].items()} for a in (default, "sha256")
    )
    print(
        f"  snapshot cost (training thread + background cpu) {default}/sha256 = "
        f"{(mine['copy'] + mine['background cpu']) / (sha['copy'] + sha['background cpu']):.3f}"
        f"; digest {default}/sha256 = {mine['digest'] / sha['digest']:.3f}"
    )


if __name__ == "__main__":
    main()
