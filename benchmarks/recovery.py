"""Time-to-recover and its parts, for node kills, preemptions with notice and worker kills, on
one machine; and what each interruption costs in lost steps and lost seconds.

Runs digits_ft three times per repeat: on a simulated 3-node cluster with node kills, on the
same cluster with preemptions (the node is drained with 8 s of notice, then killed), and on
local Ray with worker kills (2 each, one per ~8 s window, 12 epochs so training outlasts them).
For each failure it prints detection (kill ->
Ray Train noticed), Ray Train's worker-group restart (noticed -> new workers in the train
function), checkpoint download, load, batch skip, setup (the rest: model and process group in
the new workers, the resumed stream's first batch, the first step) and time-to-recover (kill ->
first trained step after the restore), then medians per kind.

Also, with one training worker per node, node kills on a fixed-size group and on an elastic
one (``trainer.min_workers=1``), for their time-to-recover ratio.

    python benchmarks/recovery.py [--repeats 1] [--kinds "node fixed,node elastic"]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from typing import Any

from hydra.core.global_hydra import GlobalHydra

from ftjob import runner
from ftjob.compose import Composer, Target
from ftjob.config import load_job, register_schema

# One training worker per node (3 CPUs a node, 2 a worker), kills at steps 20 and 100: the
# same job on a fixed-size group (Ray Train waits for the replacement node) and on an elastic
# one (continues on the node left, grows back when the replacement is there).
ONE_PER_NODE = [
    "ray.local_nodes=3",
    "ray.node_cpus=3",
    "trainer.resources_per_worker={CPU: 2}",
    "chaos=node_killer",
    "chaos.at_steps=[20,100]",
    "trainer.resize_interval=5",
]
KINDS = {
    "node kill": ["ray.local_nodes=3", "chaos=node_killer"],
    "preemption": ["ray.local_nodes=3", "chaos=preempt", "chaos.notice=8"],
    "worker kill": ["chaos=worker_killer"],
    "node fixed": ONE_PER_NODE,
    "node elastic": [*ONE_PER_NODE, "trainer.min_workers=1"],
}
COMMON = [
    "+experiment=digits_ft",
    "trainer.epochs=12",
    "chaos.interval=8",
    "chaos.max_kills=2",
    "failure.max_failures=4",
]
PARTS = (
    "detection_s",
    "restart_s",
    "download_s",
    "load_s",
    "skip_s",
    "setup_s",
    "time_to_recover_s",
)
WIDTHS = (7, 8, 9, 6, 6, 6, 6)


def run(overrides: list[str], seed: int) -> dict[str, Any]:
    register_schema()
    job = load_job(
        Composer().compose(Target("benchmark"), [*COMMON, *overrides, f"chaos.seed={seed}"])
    )
    GlobalHydra.instance().clear()
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
    if not result.ok:
        raise RuntimeError(f"run failed: {result.error}")
    return result.summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}"
    )
    args = parser.parse_args()
    kinds = {k: KINDS[k] for k in args.kinds.split(",")}
    logging.getLogger("ray").setLevel(logging.ERROR)
    records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    grows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    # Each run's batch wait outside recoveries (goodput's data_wait): a recovery that gets its
    # first batch sooner must not just move the wait after its first step.
    waits: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(args.repeats):
        for kind, overrides in kinds.items():
            summary = run(overrides, seed=r)
            if summary["metrics"]["chaos/kills"] < 2:
                raise RuntimeError(f"{kind}: only {summary['metrics']['chaos/kills']} kills landed")
            m = summary["metrics"]
            step_s = m["train/step"] / max(m["train/steps_completed"], 1)
            grows[kind].extend(x for x in summary.get("resizes", []) if x["kind"] == "grow")
            waits[kind].append(summary["goodput"]["buckets"]["data_wait"])
            for f in summary["failures"]:
                if f.get("recovered"):
                    # The rest of time-to-recover: model and process group set-up in the new
                    # workers, the first batch of the resumed stream, the first step.
                    known = sum(
                        f[p] for p in ("detection_s", "restart_s", "download_s", "load_s", "skip_s")
                    )
                    # Lost seconds: the interruption itself, then the steps trained again.
                    lost_s = f["time_to_recover_s"] + f["lost_steps"] * step_s
                    records[kind].append(
                        {**f, "setup_s": f["time_to_recover_s"] - known, "lost_s": lost_s}
                    )
            print(
                f"[repeat {r + 1}] {kind}: {len(summary['failures'])} failures, accuracy {summary['metrics']['validation/accuracy']:.3f}",
                flush=True,
            )

    header = f"{'kind':<12} {'detect':>7} {'restart':>8} {'download':>9} {'load':>6} {'skip':>6} {'setup':>6} {'TTR':>6}"
    print("\nper failure (seconds)")
    print(header)
    for kind, failures in records.items():
        for f in failures:
            print(
                f"{kind:<12} "
                + " ".join(f"{f[p]:>{w}.2f}" for p, w in zip(PARTS, WIDTHS, strict=True))
            )
    print("\nmedians (seconds); restart = Ray Train's worker-group restart")
    print(header)
    for kind, failures in records.items():
        if failures:
            med = {p: statistics.median(f[p] for f in failures) for p in PARTS}
            print(
                f"{kind:<12} "
                + " ".join(f"{med[p]:>{w}.2f}" for p, w in zip(PARTS, WIDTHS, strict=True))
            )
            print(
                f"{kind}: restart / time-to-recover = {med['restart_s'] / med['time_to_recover_s']:.2f}"
            )
    # ftjob's own share of a recovery: what the new workers spend before their first step
    # besides Ray Train's restart and the restore itself; and for node kills, everything
    # after detection and Ray Train's restart.
    med_of = {
        kind: {p: statistics.median(f[p] for f in fs) for p in PARTS}
        for kind, fs in records.items()
        if fs
    }
    print("\nmedian phases inside the new workers (seconds): set-up (process group, model),")
    print("restore (download, load, position), warm-up (first batch, first step)")
    for kind, failures in records.items():
        phases = [f.get("phases") or {} for f in failures]
        if any(phases):
            parts = {
                p: statistics.median(ph.get(p, 0.0) for ph in phases)
                for p in (
                    "setup",
                    "process_group",
                    "model",
                    "restore",
                    "warmup",
                    "first_batch",
                    "first_step",
                )
            }
            print(f"{kind:<12} " + "  ".join(f"{p} {v:.2f}" for p, v in parts.items()))
    print("\ndata wait per run (seconds, goodput's data_wait)")
    for kind, runs in waits.items():
        print(f"{kind:<12} " + " ".join(f"{w:.1f}" for w in runs))
    if "worker kill" in med_of:
        print(f"\nsetup worker-kill = {med_of['worker kill']['setup_s']:.2f} s")
    if "node kill" in med_of:
        m = med_of["node kill"]
        rest = m["time_to_recover_s"] - (m["detection_s"] + m["restart_s"])
        print(f"ttr - (detection + restart) node-kill = {rest:.2f} s")
    if "node fixed" in med_of and "node elastic" in med_of:
        ratio = (
            med_of["node elastic"]["time_to_recover_s"] / med_of["node fixed"]["time_to_recover_s"]
        )
        print(f"node-kill time-to-recover elastic/fixed = {ratio:.2f}")
    for kind, done in grows.items():
        if done:
            back = statistics.median(g["time_to_recover_s"] for g in done)
            lost = sum(g["lost_steps"] for g in done)
            print(
                f"{kind}: {len(done)} planned grows, training again after {back:.2f} s (median), {lost} steps lost"
            )
    print(
        "\nper interruption (medians): lost steps, lost seconds (time-to-recover + steps re-done)"
    )
    for kind, failures in records.items():
        if failures:
            lost_steps = statistics.median(f["lost_steps"] for f in failures)
            lost_s = statistics.median(f["lost_s"] for f in failures)
            print(f"{kind:<12} lost steps {lost_steps:>5.1f}   lost seconds {lost_s:>6.2f}")


if __name__ == "__main__":
    main()
