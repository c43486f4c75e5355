"""Bytes sent between nodes per memory snapshot, on a simulated 4-node cluster.

Runs digits_ft with the memory tier on (a snapshot every step) on a simulated cluster of a head
without CPUs and 4 worker nodes, one training worker each, for each model asked. The holders'
own counters (:class:`ftjob.memory.traffic.HolderTraffic`, said by the driver at the
run's end) give what each node's writer put in place into its own node's holder and what
reached a holder through Ray: rank 0's per-rank part (module buffers, per-rank records) for
each of its peers. The design this replaced -- one holder, on the driver's node -- received
every snapshot whole from rank 0's node; its old code is gone, so its side is computed from the
same snapshot's size (one whole snapshot per snapshot into the head; on a real cluster rank 0
never runs on a head without CPUs).

    python benchmarks/snapshot_traffic.py [--models small_cnn,resnet18] [--epochs 1]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time

from hydra.core.global_hydra import GlobalHydra

from ftjob.config import load_job, register_schema
from ftjob.config.compose import Composer, Target
from ftjob.driver import runner

NODES = 4
FOUR_NODES = [
    f"ray.local_nodes={NODES + 1}",  # the head (no training CPUs) and 4 worker nodes
    "ray.node_cpus=3",
    "trainer.resources_per_worker={CPU: 2}",  # one worker per node
    f"trainer.num_workers={NODES}",
    "ray.oversubscribe=true",  # 4 training processes on a machine of fewer cores: bytes, not speed
    "checkpoint.memory.enabled=true",
    "checkpoint.memory.every_n_steps=1",
    "chaos=disabled",
]
LINE = re.compile(
    r"memory tier: (\d+) snapshot\(s\) of ([\d.]+) MB written in place on each of (\d+) "
    r"node\(s\); between nodes (\d+) B per snapshot \(rank 0's part: (\d+) B to each peer\)"
)


def run(model: str, epochs: int) -> tuple[dict[str, float], float]:
    """The run's traffic figures (from the driver's line) and its wall time."""
    register_schema()
    overrides = ["+experiment=digits_ft", f"model={model}", f"trainer.epochs={epochs}"]
    job = load_job(Composer().compose(Target("benchmark"), [*overrides, *FOUR_NODES]))
    GlobalHydra.instance().clear()
    lines: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lines.append)
    wall = time.monotonic() - start
    if not result.ok:
        raise RuntimeError(f"{model}: the run failed: {result.error}")
    found = [m for m in map(LINE.search, lines) if m]
    if not found:
        raise RuntimeError(f"{model}: the driver said no memory-tier traffic:\n" + "\n".join(lines))
    m = found[-1]
    figures = {
        "snapshots": float(m[1]),
        "snapshot_bytes": float(m[2]) * 2**20,
        "nodes": float(m[3]),
        "between_nodes": float(m[4]),
        "part_bytes": float(m[5]),
    }
    return figures, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small_cnn,resnet18")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    rows = []
    for model in args.models.split(","):
        figures, wall = run(model, args.epochs)
        rows.append((model, figures, wall))
        print(f"{model}: {figures} in {wall:.0f} s", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"\n{'model':<10} {'nodes':>5} {'snaps':>5} {'snapshot MB':>11} {'part B':>7} "
        f"{'between nodes B/snap':>20} {'single holder B/snap':>20} {'ratio':>8}"
    )
    for model, f, _ in rows:
        single = f["snapshot_bytes"]  # rank 0's whole snapshot into the head's holder
        ratio = f["between_nodes"] / single if single else float("nan")
        print(
            f"{model:<10} {f['nodes']:>5.0f} {f['snapshots']:>5.0f} "
            f"{f['snapshot_bytes'] / 2**20:>11.2f} {f['part_bytes']:>7.0f} "
            f"{f['between_nodes']:>20.0f} {single:>20.0f} {ratio:>8.4f}"
        )
    print(
        "\nbetween nodes B/snap: what reached the holders through Ray per snapshot (rank 0's "
        "part, to each of its peers); single holder: one whole snapshot per snapshot from rank "
        "0's node to the head (computed from the same snapshot's size); ratio = per-node "
        "holders / single holder"
    )


if __name__ == "__main__":
    main()
