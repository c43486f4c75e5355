"""Sweep wall time: 4 jobs one after another (Hydra's basic launcher) against 2 at a time
(``hydra/launcher=ftjob``), same jobs, alternating order, for each job shape.

Each job is digits_ft for 2 epochs (an embedded Ray per job), in two shapes: 2 training
workers (one job keeps both cores of a 2-core machine busy) and 1 training worker (a job that
leaves room beside it, as a job smaller than its cluster does). Two jobs at a time can only
gain where one job leaves cores idle: its start-up, Ray's fixed costs, waits between steps and
restarts after kills.

    python benchmarks/sweep_parallel.py [--repeats 1] [--shapes "2 workers,1 worker"]
        [--extra "chaos=worker_killer chaos.interval=5"]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

JOBS = [
    "+experiment=digits_ft",
    "trainer.epochs=2",
    "trainer.lr=0.001,0.003",
    "checkpoint.retry.max_attempts=1,3",
]
SHAPES = {
    "2 workers": ["trainer.num_workers=2"],
    "1 worker": ["trainer.num_workers=1", "trainer.batch_size=64"],  # the same global batch
}
LAUNCHERS = {
    "sequential": [],
    "2 at a time": ["hydra/launcher=ftjob", "hydra.launcher.max_concurrent=2"],
}


def sweep(overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "ftjob", "-m", *JOBS, *overrides, f"hydra.sweep.dir={tmp}/s"],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES)
    )
    parser.add_argument("--extra", default="", help="overrides added to every job, space-separated")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",")]
    extra = args.extra.split()
    ratios = {}
    for shape in shapes:
        results: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
        for r in range(args.repeats):
            names = list(LAUNCHERS) if r % 2 == 0 else list(LAUNCHERS)[::-1]
            for name in names:
                results[name].append(sweep([*SHAPES[shape], *extra, *LAUNCHERS[name]]))
                took = results[name][-1]
                print(f"[{shape}, repeat {r + 1}] {name:<12} 4 jobs in {took:6.1f} s", flush=True)
        med = {name: statistics.median(v) for name, v in results.items()}
        ratios[shape] = med["2 at a time"] / med["sequential"]
        print(
            f"[{shape}] median wall time: sequential {med['sequential']:.1f} s, "
            f"2 at a time {med['2 at a time']:.1f} s",
            flush=True,
        )
    print()
    for shape, ratio in ratios.items():
        print(f"sweep parallel/sequential ({shape}) = {ratio:.2f}")


if __name__ == "__main__":
    main()
