"""Whole ftjob jobs on a GPU, run through its command line as a user runs them (``python -m
ftjob ...``): ResNet-50 at 224 px, bf16, channels_last, one GPU worker, decode_in=device from
the JPEG folder gpu_input.py makes (under --root; made here when it is not there).

  --part exact  the final weights after an injected failure, bit for bit: exact mode
                (trainer.exact=true: deterministic kernels) at world 1, the memory tier at every
                step, two epochs of --exact-train files; the job twice, once with
                chaos.fail_at_steps (the attempt after it restores from memory or storage) and
                once without; the two final checkpoints' model.pt compared tensor by tensor.
  --part chaos  the job under chaos: a worker SIGKILLed every --interval seconds (at most
                --kills; Ray Train restarts it, ftjob restores from the memory tier, which
                snapshots every step) on a run sized to --seconds of training at --rate
                images/s. Prints goodput (ETTR) and its buckets; the projection, by the
                first-order model summary.json's goodput.predicted is made with (ftjob/reporting/
                goodput.py's predict_ettr, mirrored here from summary.json's figures), at a kill
                every --project seconds, for this run's length and for a long run; what a
                snapshot took from the training thread against a step (target <= 10 %), and the
                interval every_n_steps=auto picks for that cost (target <= 10 steps).

Each run's summary.json (the chaos run's timeline.png too) is copied to --out. Exits non-zero
when a run fails or a target is missed.

    python benchmarks/gpu_job.py --part exact --root /tmp/gpu-data --out $OUT
    python benchmarks/gpu_job.py --part chaos --root /tmp/gpu-data --rate 3000 --seconds 90
    python benchmarks/gpu_job.py --part exact --device cpu --model small_cnn --image-size 32 \\
        --resize 36 --batch 8 --train 48 --val 8 --exact-train 32   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from gpu_input import CLASSES, ensure_data  # noqa: E402

from ftjob import metrics as M  # noqa: E402

BLOCKING_TARGET = 0.10  # of a step, what a snapshot at every step may take from training
AUTO_TARGET = 10  # steps: the interval every_n_steps=auto may pick at most
MODELED = ("training", "data_wait", "checkpoint", "detection", "restart", "restore", "setup")
MODELED += ("redone",)  # goodput.py's MODELED: the buckets the first-order model spans


def linked_tree(source: str, target: str, train: int) -> str:
    """``train`` training files under ``target``, hard links to ``source``'s (cycled through
    them under new names when there are more), and its validation split as it is."""
    if os.path.isdir(target):
        shutil.rmtree(target)
    files = sorted(
        os.path.join(folder, name)
        for folder, _, names in os.walk(os.path.join(source, "train"))
        for name in names
    )
    for i in range(train):
        folder = os.path.join(target, "train", f"class{i % CLASSES}")
        os.makedirs(folder, exist_ok=True)
        os.link(files[i % len(files)], os.path.join(folder, f"{i:06d}.jpg"))
    shutil.copytree(os.path.join(source, "val"), os.path.join(target, "val"), copy_function=os.link)
    return target


def job_overrides(args: argparse.Namespace, tree: str) -> list[str]:
    """The job as Hydra overrides: everything but what each part adds."""
    gpu = args.device == "cuda"
    cpus = max(1, (os.cpu_count() or 2) - 2)
    resources = f"{{CPU:{cpus},GPU:1}}" if gpu else "{CPU:1}"
    return [
        f"model={args.model}",
        "dataset=imagefolder",
        f"dataset.path={tree}",
        f"dataset.image_size={args.image_size}",
        f"dataset.resize_size={args.resize}",
        "optimizer=sgd",
        "trainer.lr=0.1",
        "trainer.lr_schedule=constant",
        f"trainer.use_gpu={str(gpu).lower()}",
        "trainer.num_workers=1",
        f"trainer.resources_per_worker={resources}",
        f"trainer.batch_size={args.batch}",
        f"trainer.precision={'bf16' if gpu else 'fp32'}",
        f"trainer.channels_last={str(gpu).lower()}",
        "trainer.prefetch_batches=4",
        "trainer.decode_in=device",
        "checkpoint.memory.enabled=true",
        "checkpoint.memory.every_n_steps=1",
    ]


def run_job(overrides: list[str], run_dir: str, env: dict[str, str] | None = None) -> dict:
    """``python -m ftjob OVERRIDES`` (its output passed through); its summary.json."""
    command = [sys.executable, "-m", "ftjob", *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, check=False)
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        raise RuntimeError(f"python -m ftjob exited {done.returncode} without a summary.json")
    with open(path) as f:
        summary = json.load(f)
    print(
        f"-- {os.path.basename(run_dir)}: {summary['status']} in {time.perf_counter() - start:.0f} s "
        f"(exit {done.returncode})",
        flush=True,
    )
    return summary


def keep(run_dir: str, out: str | None, prefix: str, files: tuple[str, ...]) -> None:
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    for name in files:
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            shutil.copyfile(path, os.path.join(out, f"{prefix}_{name}"))


def final_weights(summary: dict[str, Any]) -> dict[str, torch.Tensor]:
    from ftjob.storage.checkpoint import checkpoint_file

    latest = summary["checkpoints"]["latest"]
    data = checkpoint_file(latest, "model.pt")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """Bit for bit, tensor by tensor: (identical, what differs)."""
    if a.keys() != b.keys():
        return False, f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}"
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if not differ:
        return True, f"bit-identical ({len(a)} tensors)"
    floats = [k for k in differ if a[k].is_floating_point()]
    worst = max(((a[k].double() - b[k].double()).abs().max().item() for k in floats), default=0)
    return False, f"differ: {len(differ)} of {len(a)} tensors (max |difference| {worst:.3g})"


def exact(args: argparse.Namespace, tree: str, work: str) -> bool:
    """The final weights after an injected failure against the unkilled run's."""
    small = linked_tree(tree, os.path.join(work, "exact_tree"), args.exact_train)
    steps = args.exact_train // args.batch  # an epoch's
    fail_at = steps + max(1, steps // 2)  # in the second epoch, past its first checkpoint
    base = job_overrides(args, small) + [
        "trainer.exact=true",
        "trainer.epochs=2",
        f"trainer.checkpoint_every_n_steps={max(2, steps // 2)}",
        f"trainer.log_every_n_steps={max(1, steps // 2)}",
    ]
    runs = {}
    for name, extra in (
        ("unkilled", []),
        ("failed", [f"chaos.fail_at_steps=[{fail_at}]", "failure.max_failures=1"]),
    ):
        run_dir = os.path.join(work, f"exact_{name}")
        # cuBLAS's deterministic workspace from the workers' start: ftjob sets it before its
        # first step, this sets it before anything in a worker could start cuBLAS
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        runs[name] = run_job(base + extra + [f"name=gpu-exact-{name}"], run_dir, env)
        keep(run_dir, args.out, f"exact_{name}", ("summary.json",))
    failed = runs["failed"]
    restores = [
        f"step {f.get('restored_step')} from {f.get('tier')} ({f.get('holder')}), "
        f"lost {f.get('lost_steps')} steps"
        for f in failed["failures"]
    ]
    print(f"the failed run: an injected failure at step {fail_at}, restored {'; '.join(restores)}")
    if not all(r["status"] == "succeeded" for r in runs.values()) or not failed["failures"]:
        print("final weights after a failure: FAIL (a run did not succeed, or nothing failed)")
        return False
    same, said = compare(final_weights(runs["unkilled"]), final_weights(failed))
    print(
        f"final weights after a failure, exact mode, decode_in=device, world 1: {said} "
        f"({'PASS' if same else 'FAIL'}: bit-identical)",
        flush=True,
    )
    return same


def project(
    goodput: dict[str, Any], mtbf_s: float, expected: float | None = None
) -> tuple[float, float] | None:
    """The first-order model of ftjob/reporting/goodput.py (predict_ettr) at a failure every
    ``mtbf_s`` seconds (or ``expected`` failures in this run), from summary.json's goodput:
    (ETTR for a run as long as this one, ETTR for a long run -- start-up, validation and the
    end amortised away). Its terms are the run's own: the recovery R and the span L a failure
    goes back by (memory snapshots and checkpoints both count) per failure, the checkpoints'
    and snapshots' stall per second trained, the share of step time not waiting for data.
    None without a prediction."""
    predicted = goodput.get("predicted")
    b = goodput["buckets"]
    step_time = b["training"] + b["data_wait"]
    if not predicted or step_time <= 0 or goodput["wall_s"] <= 0:
        return None
    loss = predicted["recovery_s"] + predicted["restorable_every_s"] / 2
    overhead = b["checkpoint"] / step_time
    modeled = sum(b[k] for k in MODELED)
    failures = modeled / mtbf_s if expected is None else expected
    useful = max(0.0, modeled - failures * loss) / (1 + overhead)
    this_run = useful * (b["training"] / step_time) / goodput["wall_s"]
    long_run = max(0.0, 1 - loss / mtbf_s) / (1 + overhead) * (b["training"] / step_time)
    return this_run, long_run


def chaos(args: argparse.Namespace, tree: str, work: str) -> bool:
    """The job under worker kills: goodput, its projection, the snapshot's blocking."""
    from ftjob.policy.cadence import snapshot_interval

    big = linked_tree(tree, os.path.join(work, "chaos_tree"), args.chaos_train)
    epochs = args.epochs or max(2, round(args.rate * args.seconds / args.chaos_train))
    run_dir = os.path.join(work, "chaos")
    overrides = job_overrides(args, big) + [
        f"trainer.epochs={epochs}",
        "trainer.log_every_n_steps=100",
        "checkpoint.upload_mode=async",
        "chaos=worker_killer",
        f"chaos.interval={args.interval}",
        f"chaos.max_kills={args.kills}",
        f"failure.max_failures={args.kills + 1}",
        "name=gpu-chaos",
    ]
    print(
        f"chaos run: {epochs} epochs of {args.chaos_train} images (planned {args.seconds:.0f} s "
        f"at {args.rate:.0f} images/s), a worker killed every ~{args.interval:g} s, "
        f"at most {args.kills}",
        flush=True,
    )
    summary = run_job(overrides, run_dir)
    keep(run_dir, args.out, "chaos", ("summary.json", "timeline.png"))
    m, g = summary["metrics"], summary["goodput"]
    ok = summary["status"] == "succeeded"
    for f in summary["failures"]:
        detect, back = (f.get(k) or 0.0 for k in ("detection_s", "time_to_recover_s"))
        print(
            f"  failure ({f['kind']}): detect {detect:.1f} s, time to recover {back:.1f} s, "
            f"restored step {f.get('restored_step')} from {f.get('tier')}, lost "
            f"{f.get('lost_steps')} steps{'' if f.get('recovered') else ': ' + str(f.get('error'))}"
        )
    buckets = ", ".join(f"{k} {v:.1f}" for k, v in g["buckets"].items() if v)
    print(f"goodput: ETTR {g['ettr']:.3f} of {g['wall_s']:.0f} s ({buckets})")
    kills = int(m[M.CHAOS_KILLS])
    predicted = g.get("predicted")
    if predicted and kills:
        here = project(g, args.interval, expected=predicted["expected_failures"])
        at = project(g, args.project)
        assert here is not None and at is not None
        print(
            f"first-order model (R {predicted['recovery_s']:.1f} s a failure, back "
            f"{predicted['restorable_every_s']:.2f} s of training, stall "
            f"{g['buckets']['checkpoint']:.1f} s): summary.json's predicted ETTR "
            f"{predicted['ettr']:.3f} at this run's kill rate (mirrored here: {here[0]:.3f}); "
            f"at a kill every {args.project:g} s: {at[0]:.3f} for a run this long, "
            f"{at[1]:.3f} for a long run"
        )
    else:
        print("first-order model: no projection (no kill landed, or no checkpoint)")
    snapshots = m[M.CHECKPOINT_MEMORY_SNAPSHOTS]
    steps = m[M.TRAIN_STEPS_COMPLETED]
    if snapshots and steps:
        lost = m[M.CHECKPOINT_MEMORY_SNAPSHOT_TIME] / snapshots
        step = m[M.TRAIN_STEP] / steps
        share, auto = lost / step, snapshot_interval(lost, step, 0.02)
        ok &= share <= BLOCKING_TARGET and auto <= AUTO_TARGET
        print(
            f"memory tier at every step: {int(snapshots)} snapshots, the training thread lost "
            f"{lost * 1e3:.2f} ms a snapshot (waiting {m[M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT] / snapshots * 1e3:.2f} ms "
            f"of it) against {step * 1e3:.1f} ms a step: {share:.1%} "
            f"({'PASS' if share <= BLOCKING_TARGET else 'FAIL'}: <= {BLOCKING_TARGET:.0%}); "
            f"every_n_steps=auto picks {auto} steps at checkpoint.memory.max_overhead=0.02 "
            f"({'PASS' if auto <= AUTO_TARGET else 'FAIL'}: <= {AUTO_TARGET})"
        )
    else:
        ok = False
        print("memory tier: no snapshot taken")
    print(
        f"chaos run: {summary['status']}, {kills} kills, {int(steps)} steps, "
        f"{m[M.TRAIN_GLOBAL_THROUGHPUT]:.0f} images/s",
        flush=True,
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=["exact", "chaos"], required=True)
    parser.add_argument("--root", default=None, help="gpu_input.py's files (made if missing)")
    parser.add_argument("--out", default=None, help="where the runs' summaries are copied")
    parser.add_argument("--train", type=int, default=8192, help="gpu_input.py's --train")
    parser.add_argument("--val", type=int, default=256, help="gpu_input.py's --val")
    parser.add_argument("--exact-train", type=int, default=2048, help="files an exact epoch")
    parser.add_argument("--chaos-train", type=int, default=32768, help="files a chaos epoch")
    parser.add_argument("--rate", type=float, default=1000.0, help="images/s to size the run")
    parser.add_argument("--seconds", type=float, default=90.0, help="of training, planned")
    parser.add_argument("--epochs", type=int, default=0, help="the chaos run's (0: sized)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between kills")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--project", type=float, default=480.0, help="seconds between kills")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", default="resnet50", choices=["resnet50", "small_cnn"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = args.root or tempfile.mkdtemp(prefix="ftjob-gpu-input-")
    tree, _ = ensure_data(root, args.train, args.val)
    work = tempfile.mkdtemp(prefix=f"ftjob-gpu-{args.part}-", dir=root)
    try:
        ok = exact(args, tree, work) if args.part == "exact" else chaos(args, tree, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
