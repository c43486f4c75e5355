"""The memory tier against storage, side by side in one run.

1. Restore (fetch + verify + load) of a ResNet-50-sized training state -- torchvision's
   ResNet-50 and its SGD momentum, ~200 MB -- through ftjob's own restore
   (``Checkpointer.restore``): from the memory tier's holder (a Ray actor in another process,
   as in a run) against the same state committed to S3 (moto's server on loopback, started
   here). Interleaved, medians; prints ``restore s3/memory = X``.
2. Training throughput with the tier on (a snapshot after every step) against off, on the same
   digits job, alternating; prints ``memory-tier throughput on/off = X``.

    python benchmarks/memory_tier.py [--repeats 5] [--runs 2] [--skip-restore | --skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from storage_bench import create_bucket, moto_server  # noqa: E402

from ftjob import metrics as M  # noqa: E402
from ftjob.config import CheckpointConfig, MemoryConfig, RetryConfig  # noqa: E402
from ftjob.memory.tier import MemoryTier  # noqa: E402
from ftjob.storage.fs import build_filesystem  # noqa: E402
from ftjob.worker.checkpointer import Checkpointer, TrainState  # noqa: E402
from ftjob.worker.recorder import RunRecorder  # noqa: E402


class Quiet:
    """A ledger handle that takes every call and answers nothing."""

    def __getattr__(self, name: str) -> Any:
        return type("Call", (), {"remote": staticmethod(lambda *args: None)})()


def resnet50_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torchvision.models.resnet50(num_classes=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # momentum buffers exist: the state a resumed run needs
    return model, optimizer


def checkpointer(storage: str, options: dict[str, Any], holder: Any, scratch: str) -> Checkpointer:
    import ray

    metrics = M.MetricSet()
    recorder = RunRecorder(Quiet(), 0, lambda value, timeout=None: value, attempt=0)
    fs, path = build_filesystem(storage, options, RetryConfig())
    tier = MemoryConfig(enabled=True, max_mb=4096)
    return Checkpointer(
        fs=fs,
        run_path=path,
        config=CheckpointConfig(num_to_keep=1),
        job_config={},
        recorder=recorder,
        world=1,
        broadcast=lambda obj: obj,
        report=lambda metrics: None,
        metrics=metrics,
        local_root=scratch,
        global_batch=256,
        memory=MemoryTier(holder, tier, 0, metrics, ray.get, print) if holder else None,
    )


def restore_bench(repeats: int) -> None:
    import ray

    from ftjob.memory import start_holder

    model, optimizer = resnet50_state()
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    size += sum(
        t.numel() * t.element_size()
        for s in optimizer.state_dict()["state"].values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    print(f"state: ResNet-50 + SGD momentum, {size / 2**20:.0f} MB")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with moto_server() as endpoint, tempfile.TemporaryDirectory() as scratch:
            bucket = create_bucket(endpoint)
            options = {"endpoint_url": endpoint}
            storage = f"s3://{bucket}/run"
            s3 = checkpointer(storage, options, None, os.path.join(scratch, "s3"))
            s3.save(TrainState(step=100), model, optimizer)  # committed to S3
            holder = start_holder(4096, 1)
            memory = checkpointer(storage, options, holder, os.path.join(scratch, "mem"))
            tensors = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}
            state = TrainState(step=101)
            memory.memory.take(101, tensors, memory._records(state))
            memory.memory.wait()
            times: dict[str, list[float]] = {"storage": [], "memory": []}
            for _ in range(repeats):  # interleaved: the machine's noise hits both alike
                for tier, c in (("storage", s3), ("memory", memory)):
                    fresh, fresh_opt = resnet50_state()
                    start = time.perf_counter()
                    restored = c.restore(fresh, fresh_opt, torch.device("cpu"))
                    times[tier].append(time.perf_counter() - start)
                    assert restored is not None and restored.tier == tier, restored
            for tier, where in (("storage", "s3 (loopback moto)"), ("memory", "memory (holder)")):
                shown = " ".join(f"{t:.2f}" for t in times[tier])
                print(
                    f"restore from {where}: median {statistics.median(times[tier]):.2f} s ({shown})"
                )
            ratio = statistics.median(times["storage"]) / statistics.median(times["memory"])
            print(f"restore s3/memory = {ratio:.1f}")
    finally:
        ray.shutdown()


def throughput_bench(runs: int) -> None:
    """Alternating runs of the same digits job, tier off and on; img/s from summary.json."""
    job = ["+experiment=digits_ft", "trainer.epochs=4", "trainer.log_every_n_steps=1000"]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(runs):
        for name in ("off", "on"):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [
                    sys.executable,
                    "-m",
                    "ftjob",
                    *job,
                    f"checkpoint.memory.enabled={name == 'on'}",
                    f"hydra.run.dir={tmp}/run",
                ]
                subprocess.run(cmd, cwd=tmp, check=True, capture_output=True)
                with open(f"{tmp}/run/summary.json") as f:
                    s = json.load(f)
                rates[name].append(s["metrics"][M.TRAIN_GLOBAL_THROUGHPUT])
                snaps = s["metrics"][M.CHECKPOINT_MEMORY_SNAPSHOTS]
                stall = s["metrics"][M.CHECKPOINT_MEMORY_SNAPSHOT_TIME]
                print(
                    f"tier {name}: {rates[name][-1]:.0f} img/s, snapshots {snaps:.0f}, stalled {stall:.2f} s"
                )
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    # Each run beside the one before it: the machine drifts between pairs more than within one.
    pairs = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
    print(
        f"paired runs on/off: {' '.join(f'{p:.3f}' for p in pairs)}, median {statistics.median(pairs):.3f}"
    )
    print(f"memory-tier throughput on/off = {on / off:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-restore", action="store_true")
    args = parser.parse_args()
    # moto's loopback server takes any credentials; boto3 wants some.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "ftjob-bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "ftjob-bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if not args.skip_restore:
        restore_bench(args.repeats)
    if not args.skip_throughput:
        throughput_bench(args.runs)


if __name__ == "__main__":
    main()
