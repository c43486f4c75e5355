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
   training thread (``take``: the copy itself is the background thread's since it left the
   step), the background thread's wall and CPU, and the digest's share.
4. ``blocking``: what a snapshot after every step takes from a training loop (forward,
   backward, ``settle``, optimizer step, snapshot), four ways in blocks of ``--steps`` steps
   taking turns: no tier; the tier before its copy moved beside the step (:data:`PREVIOUS`,
   read from git); the copy waited for in ``take`` (on a GPU the stream synchronised, as the
   copy into host memory did); the copy beside the next step (the tier as it is). Per way: the step's time, what the training
   thread lost per snapshot (``take``, the wait at ``settle``, the device's wait), its share of
   a step, the whole process's extra CPU per snapshot, and the interval
   ``every_n_steps=auto`` would pick at its 2 % (the cost it weighs: the training thread's on a
   GPU, with the extra CPU on the CPU). ``--model small_cnn`` is digits' model and state;
   :mod:`benchmarks.gpu_snapshot_copy` runs it on a GPU.

    python benchmarks/snapshot_cost.py [--snapshots 200] [--big-snapshots 10]
        [--only digits|checksums|resnet50|blocking] [--model resnet50] [--image-size 64]
        [--batch 8] [--steps 4] [--rounds 5] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch
import torch.nn.functional as F
import torchvision
import xxhash

from ftjob import metrics as M
from ftjob.config import MemoryConfig
from ftjob.memory import (
    Flat,
    Snapshot,
    SnapshotHolder,
    digest_all,
    pack,
    start_holder,
    state_bytes,
)
from ftjob.memory import format as fmt
from ftjob.memory.tier import MemoryTier
from ftjob.models import SmallCNN
from ftjob.policy.cadence import snapshot_interval
from ftjob.worker.checkpointer import snapshot_tensors


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
    parser.add_argument("--only", choices=["digits", "checksums", "resnet50", "blocking"])
    add_loop_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # 1: as in a Ray Train worker that reserves one CPU
    if args.only in (None, "digits"):
        digits(args.snapshots)
    if args.only in (None, "checksums", "resnet50"):
        flats = resnet50_flats()
        if args.only in (None, "checksums"):
            checksums(flats)
        if args.only in (None, "resnet50"):
            resnet50_snapshots(args.big_snapshots)
    if args.only in (None, "blocking"):
        blocking(args)


def add_loop_arguments(parser: argparse.ArgumentParser, device: str = "cpu") -> None:
    """The training loop of the ``blocking`` part: its model, batch, blocks and device."""
    parser.add_argument("--model", default="resnet50", help="a torchvision model, or small_cnn")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps a block, a way a block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each way")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument("--device", default=device)
    parser.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    parser.add_argument("--channels-last", action="store_true")


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


WAYS = ("no tier", "before", "copy in take", "copy beside the step")
PREVIOUS = "f69b8eef6d277ac10dd0d9cb5c0927ebccaae497"  # the tier before its copy left the step
MOVED = {
    "ftjob.storage.memory": "ftjob.memory",
    "ftjob.worker.nearest_copy": "ftjob.memory.nearest_copy",
    "ftjob.worker.node_holders": "ftjob.memory.node_holders",
}


def previous_tier() -> type | None:
    """``MemoryTier`` as it was at :data:`PREVIOUS` (the copy on the training thread, in
    ``take``), read from this repository's history; None where git cannot give it."""
    try:
        source = subprocess.run(
            ["git", "show", f"{PREVIOUS}:ftjob/worker/snapshots.py"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"the tier before the change could not be read from git ({exc}): left out")
        return None
    for moved, home in MOVED.items():  # the modules it imports, where they live now
        source = source.replace(moved, home)
    module = types.ModuleType("previous_snapshots")
    exec(compile(source, "previous_snapshots.py", "exec"), module.__dict__)
    return module.MemoryTier


def blocking(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The ``blocking`` part (see the module's docstring); returns each way's figures."""
    device = torch.device(args.device)
    loop = TrainingLoop(args, device)
    tiers: dict[str, Any] = {"no tier": None}
    for way in WAYS[1:]:
        holder = Direct(SnapshotHolder(4 * 2**30, 2))
        config = MemoryConfig(enabled=True, max_mb=4096.0)
        tier_class = previous_tier() if way == "before" else MemoryTier
        if tier_class is not None:
            tiers[way] = tier_class(holder, config, 0, M.MetricSet(), lambda x: x, print)
    figures: dict[str, dict[str, list[float]]] = {way: {} for way in tiers}
    for round_ in range(args.rounds + 1):  # the first round warms up (the ring, the kernels)
        for way, tier in tiers.items():
            measured = loop.block(tier, in_take=way == "copy in take", steps=args.steps)
            if round_:
                for key, value in measured.items():
                    figures[way].setdefault(key, []).append(value)
    for tier in tiers.values():
        if tier is not None and tier._thread is not None:
            thread = tier._thread
            tier.close(10.0)
            thread.join(10.0)  # not running into the interpreter's end
    size = state_bytes(snapshot_tensors(loop.model, loop.optimizer))
    return report(figures, device, size, args)


class TrainingLoop:
    """A model, its optimizer (SGD with momentum) and one batch on ``device``: steps as the
    worker takes them, a snapshot after each."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(0)
        if args.model == "small_cnn":
            self.model: torch.nn.Module = SmallCNN(num_classes=10)
        else:
            self.model = getattr(torchvision.models, args.model)(num_classes=1000)
        self.model = self.model.to(device)
        layout = torch.channels_last if args.channels_last else torch.contiguous_format
        self.model = self.model.to(memory_format=layout)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        size, classes = args.image_size, 10 if args.model == "small_cnn" else 1000
        self.images = torch.randn(args.batch, 3, size, size, device=device)
        self.images = self.images.contiguous(memory_format=layout)
        self.labels = torch.randint(0, classes, (args.batch,), device=device)
        self.device, self.bf16, self.step = device, args.bf16, 0
        self.records = {"state.json": {"step": 0}, "config.json": {}}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def block(self, tier: Any, in_take: bool, steps: int) -> dict[str, float]:
        """``steps`` steps, a snapshot after each (a due one is skipped while the last is
        still being written, as in a run): seconds per step, and per snapshot taken the
        training thread's loss and the process's CPU."""
        held = tier.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOTS) if tier else 0.0
        skipped = tier.skipped if tier else 0
        lost = 0.0
        self.sync()
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = F.cross_entropy(self.model(self.images), self.labels)
            loss.backward()
            if hasattr(tier, "settle"):  # (the tier before the change had no wait there)
                waited = time.perf_counter()
                tier.settle()
                lost += time.perf_counter() - waited
            self.optimizer.step()
            self.step += 1
            if tier is not None:
                taking = time.perf_counter()
                tier.take(self.step, snapshot_tensors(self.model, self.optimizer), self._records)
                if in_take:  # the copy waited for here, as the copy into host memory did
                    tier.settle()
                    self.sync()
                lost += time.perf_counter() - taking
        self.sync()
        wall = time.perf_counter() - start
        if tier is not None:
            tier.wait()
        cpu = time.process_time() - cpu
        if hasattr(tier, "copier"):
            lost += tier.copier.stalled()  # the device's waits at settle, all passed by now
        taken = (
            (tier.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOTS) - held) if tier is not None else 0.0
        )
        assert tier is None or taken + (tier.skipped - skipped) == steps
        return {
            "step": wall / steps,
            "lost": lost / max(taken, 1.0),
            "cpu": cpu / steps,
            "taken": taken / steps,
        }

    def _records(self) -> dict[str, Any]:
        return self.records


def report(
    figures: dict[str, dict[str, list[float]]],
    device: torch.device,
    size: int,
    args: argparse.Namespace,
) -> dict[str, dict[str, float]]:
    """Medians a way, its ratios to the copy in take, and what ``every_n_steps=auto`` picks."""
    med = {way: {k: statistics.median(v) for k, v in f.items()} for way, f in figures.items()}
    base = med["no tier"]
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} cores"
    )
    print(
        f"\n{args.model} ({size / 2**20:.1f} MiB of state) on {device} ({where}), batch "
        f"{args.batch} at {args.image_size} px{', bf16' if args.bf16 else ''}, a snapshot after "
        f"every step, {args.rounds} blocks of {args.steps} steps a way, medians:"
    )
    for way in [w for w in WAYS[1:] if w in med]:
        m = med[way]
        extra_cpu = max(0.0, m["cpu"] - base["cpu"]) / max(m["taken"], 1e-9)
        cost = m["lost"] + (extra_cpu if device.type == "cpu" else 0.0)
        m["interval"] = snapshot_interval(cost, base["step"], 0.02)
        m["share"] = m["lost"] / base["step"]
        print(
            f"  {way:<21} step {1e3 * m['step']:8.2f} ms (no tier {1e3 * base['step']:.2f}: "
            f"x{m['step'] / base['step']:.3f})   training thread lost {1e3 * m['lost']:7.2f} ms "
            f"a snapshot ({100 * m['share']:.1f} % of a step)   extra CPU {1e3 * extra_cpu:7.2f} ms"
            f"   taken {100 * m['taken']:.0f} %   every_n_steps=auto: {m['interval']}"
        )
    now = med["copy beside the step"]
    for way in ("before", "copy in take"):
        if way in med:
            print(
                f"  beside/{way}: training thread lost {now['lost'] / med[way]['lost']:.3f}, "
                f"step {now['step'] / med[way]['step']:.3f}"
            )
    return med


if __name__ == "__main__":
    main()
