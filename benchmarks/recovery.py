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

Beside ftjob's worker kills, the engine underneath recovering from the same kills: a
hand-written Ray Train loop on the same job (benchmarks/raytrain_recovery.py, kind ``raytrain
worker kill``), time-to-recover side by side and their ratio.

Also, with one training worker per node, node kills on a fixed-size group and on an elastic
one (``trainer.min_workers=1``), for their time-to-recover ratio; and node and worker kills
with the memory tier on (``<kind> +tier``) against off: ``back-to-step <kind> tier/no-tier``,
the time from a kill until the run is back at the step it had reached.

``--set KEY=VALUE`` (repeatable) changes the job of every kind, e.g. a model whose steps
weigh (``--set model=resnet18``: ~0.5 s a step here against small_cnn's ~0.06 s) or durable
checkpoints further apart (``--set trainer.checkpoint_every_n_steps=100``): where a kill makes a
run train steps again, the tier's snapshots every step save them. The tier's comparison as
benchmarks/RESULTS.md records it: a step of ~0.5 s, durable checkpoints every 50 steps, a kill
in each 40 s window (on the default job a kill costs ~0.5 s of redone steps, less than the
spread of Ray Train's restart):

    python benchmarks/recovery.py --repeats 2 \
        --kinds "worker kill,worker kill +tier,node kill,node kill +tier" \
        --set model=resnet18 --set trainer.epochs=6 \
        --set trainer.checkpoint_every_n_steps=50 --set chaos.interval=40

    python benchmarks/recovery.py [--repeats 1] [--kinds "node fixed,node elastic"]
                                  [--set model=resnet18 --set trainer.epochs=6]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from hydra.core.global_hydra import GlobalHydra

from ftjob.config import load_job, register_schema
from ftjob.config.compose import Composer, Target
from ftjob.driver import runner

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
    "raytrain worker kill": [],  # the hand-written Ray Train loop (raytrain_recovery.py)
}
# The same kills with the memory tier (a snapshot every step): "<kind> +tier".
TIER = ["checkpoint.memory.enabled=true"]
for _kind in ("node kill", "worker kill"):
    KINDS[f"{_kind} +tier"] = [*KINDS[_kind], *TIER]
RAYTRAIN = "raytrain worker kill"
COMMON = [
    "+experiment=digits_ft",
    "checkpoint.memory.enabled=false",  # digits_ft's tier is on: off but for the "+tier" kinds
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


def run(overrides: list[str], seed: int, extra: list[str]) -> dict[str, Any]:
    register_schema()
    job = load_job(
        Composer().compose(Target("benchmark"), [*COMMON, *overrides, *extra, f"chaos.seed={seed}"])
    )
    GlobalHydra.instance().clear()
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
    if not result.ok:
        raise RuntimeError(f"run failed: {result.error}")
    return result.summary.document()  # the summary.json form


def run_raytrain(seed: int) -> list[dict[str, Any]]:
    """The hand-written Ray Train loop with COMMON's epochs and kills, in a fresh process."""
    opts = dict(o.split("=", 1) for o in COMMON if "=" in o)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "recoveries.json")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raytrain_recovery.py")
        args = [opts["trainer.epochs"], opts["chaos.interval"], opts["chaos.max_kills"]]
        subprocess.run(
            [sys.executable, script, out, str(seed), *args],
            check=True,
            capture_output=True,
            timeout=900,
        )
        with open(out) as f:
            return json.load(f)


def compare_with_raytrain(ftjob: list[dict[str, Any]], raytrain: list[dict[str, Any]]) -> None:
    """Worker kills, ftjob against the hand-written loop: medians and the time-to-recover
    ratio. ftjob's train-function clock starts at its attempt's registration (a little after
    the entry); its restore is in its set-up side, as the loop's is."""
    rows = {
        "ftjob": [
            (
                f["detection_s"] + f["restart_s"],
                f["time_to_recover_s"] - f["detection_s"] - f["restart_s"],
                f["time_to_recover_s"],
                f["lost_steps"],
            )
            for f in ftjob
        ],
        "raytrain": [
            (r["to_train_fn_s"], r["train_fn_to_step_s"], r["time_to_recover_s"], r["lost_steps"])
            for r in raytrain
        ],
    }
    med = {
        name: tuple(statistics.median(col) for col in zip(*values, strict=True))
        for name, values in rows.items()
    }
    header = f"{'':<9} {'kill->train fn':>15} {'train fn->step':>15} {'TTR':>6} {'lost steps':>11}"
    for title, table in (("(seconds)", rows), ("medians", {k: [v] for k, v in med.items()})):
        print(f"\nworker kills, ftjob and the hand-written Ray Train loop {title}")
        print(header)
        for name, values in table.items():
            for a, b, c, d in values:
                print(f"{name:<9} {a:>15.2f} {b:>15.2f} {c:>6.2f} {d:>11.1f}")
    print(
        f"worker-kill time-to-recover ftjob/raytrain = {med['ftjob'][2] / med['raytrain'][2]:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every kind's job (after the benchmark's own), repeatable",
    )
    args = parser.parse_args()
    extra: list[str] = args.set
    for item in extra:
        if item.split("=", 1)[0].lstrip("+~") in ("checkpoint.memory", "checkpoint.memory.enabled"):
            parser.error(
                f"--set {item}: the kinds choose the memory tier (on for the '+tier' kinds, off "
                "for the rest); compare them with --kinds"
            )
    if extra:
        print(f"every job with: {' '.join(extra)}", flush=True)
    kinds = {k: KINDS[k] for k in args.kinds.split(",")}
    logging.getLogger("ray").setLevel(logging.ERROR)
    records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds if kind != RAYTRAIN}
    baseline: list[dict[str, Any]] = []  # the hand-written loop's recoveries
    grows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in records}
    # Each run's batch wait outside recoveries (goodput's data_wait): a recovery that gets its
    # first batch sooner must not just move the wait after its first step.
    waits: dict[str, list[float]] = {kind: [] for kind in records}
    for r in range(args.repeats):
        for kind, overrides in kinds.items():
            if kind == RAYTRAIN:
                baseline.extend(run_raytrain(seed=r))
                print(f"[repeat {r + 1}] {kind}: {len(baseline)} recoveries so far", flush=True)
                continue
            summary = run(overrides, seed=r, extra=extra)
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
        if baseline:
            compare_with_raytrain(records["worker kill"], baseline)
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
    # Back to the step it had reached: from the kill, recovery plus the steps done again.
    for kind in ("worker kill", "node kill"):
        tier, plain = records.get(f"{kind} +tier"), records.get(kind)
        if tier and plain:
            ratio = statistics.median(f["lost_s"] for f in tier) / statistics.median(
                f["lost_s"] for f in plain
            )
            restored = sum(1 for f in tier if f.get("tier") == "memory")
            print(
                f"back-to-step {kind.replace(' ', '-')} tier/no-tier = {ratio:.2f} "
                f"({restored} of {len(tier)} restores from memory)"
            )


if __name__ == "__main__":
    main()
