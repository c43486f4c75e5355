"""Sweep wall time: 4 jobs one after another (Hydra's basic launcher) against 2 at a time
(``hydra/launcher=ftjob``), same jobs, alternating order.

Each job is digits_ft for 2 epochs on 2 workers (an embedded Ray per job). On a 2-core machine
two jobs at a time share the cores; what they overlap is each job's start-up, Ray's fixed
costs and the waits between steps.

    python benchmarks/sweep_parallel.py [--repeats 1]
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
LAUNCHERS = {
    "sequential": [],
    "2 at a time": ["hydra/launcher=ftjob", "hydra.launcher.max_concurrent=2"],
}


def sweep(launcher: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "ftjob", "-m", *JOBS, *launcher, f"hydra.sweep.dir={tmp}/s"],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    for r in range(args.repeats):
        names = list(LAUNCHERS) if r % 2 == 0 else list(LAUNCHERS)[::-1]
        for name in names:
            results[name].append(sweep(LAUNCHERS[name]))
            print(f"[repeat {r + 1}] {name:<12} 4 jobs in {results[name][-1]:6.1f} s", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(
        f"\nmedian wall time: sequential {med['sequential']:.1f} s, 2 at a time {med['2 at a time']:.1f} s"
    )
    print(f"sweep parallel/sequential = {med['2 at a time'] / med['sequential']:.2f}")


if __name__ == "__main__":
    main()
