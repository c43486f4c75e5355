"""Back to the step after a driver's death, the cluster kept: the next driver restoring from the
snapshots the holders kept against restoring from storage.

Starts a cluster with ``ray start --head`` (4 CPUs, its own temp dir and ports), then per
variant (memory tier on, off) and repeat: digits_ft with ``resume=auto`` under a fresh run
name, durable checkpoints at the epoch ends only (steps 22, 44), a progress line every step, no preemption notices
(Ray ends a dead driver's workers with SIGTERM: a notice would commit a just-in-time
checkpoint of this small state); the driver is SIGKILLed at the first progress line at or past
step ``--kill-at`` (8 past its newest checkpoint; its workers train on a few steps until Ray
ends them), and once Ray has ended its workers the same
command runs again. Back-to-step: from the rerun's start to the end of the first step at or past
the step the killed driver last printed (the rerun's own progress times), and what it
restored. Medians and ``back-to-step tier/no-tier``.

    python benchmarks/driver_kill.py [--repeats 1] [--kill-at 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRESS = re.compile(r" step (\d+)/\d+ loss ")
RESTORED = re.compile(r"restored step (\d+) .* from (\S+):")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_head(temp_dir: str) -> tuple[subprocess.Popen[bytes], int]:
    """``ray start --head --block`` in a process group of its own; returns once its GCS
    accepts connections."""
    port = free_port()
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return head, port
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the head did not start") from None
            time.sleep(0.5)


def train_workers(root: int) -> list[int]:
    """Live Ray Train worker processes below process ``root``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"RayTrainWorker" in f.read():
                        found.append(child)
            except OSError:
                continue
    return found


def driver(args: list[str], run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def one(tier: bool, name: str, tmp: Path, kill_at: int, head: int, env: dict[str, str]) -> dict:
    command = [
        "+experiment=digits_ft",
        "trainer.epochs=3",
        "trainer.checkpoint_every_n_steps=100",  # durable at the epoch ends only: 22, 44
        "trainer.log_every_n_steps=1",
        "failure.preemption=false",
        f"checkpoint.memory.enabled={str(tier).lower()}",
        f"checkpoint.storage_path={tmp / 'ckpt'}",
        "checkpoint.shared_filesystem=true",
        "ray.address=auto",
        "resume=auto",
        f"name={name}",
    ]
    killed = driver(command, tmp / f"{name}-killed", env)
    printed = 0
    assert killed.stdout is not None
    for line in killed.stdout:
        m = PROGRESS.search(line)
        if m and int(m[1]) >= kill_at:
            printed = int(m[1])
            break
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    if not printed:
        raise RuntimeError(f"{name}: the first driver ended before step {kill_at}")
    deadline = time.monotonic() + 120
    while train_workers(head) and time.monotonic() < deadline:
        time.sleep(0.2)
    rerun = driver(command, tmp / f"{name}-rerun", env)
    console, _ = rerun.communicate(timeout=900)
    if rerun.returncode != 0:
        raise RuntimeError(f"{name}: the rerun failed:\n{console[-3000:]}")
    summary = json.loads((tmp / f"{name}-rerun" / "summary.json").read_text())
    restored = RESTORED.search(console)
    start = summary["timing"]["run_started"]
    reached = [p["time"] for p in summary["history"] if p["step"] >= printed]
    if not reached:
        raise RuntimeError(f"{name}: the rerun never printed step {printed}:\n{console[-3000:]}")
    back = reached[0] - start
    first = summary["timing"]["first_step"] - start
    return {
        "tier": tier,
        "killed_at": printed,
        "restored": int(restored[1]) if restored else 0,
        "from": "memory" if restored and restored[2].startswith("memory:") else "storage",
        "first_step_s": first,
        "back_to_step_s": back,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=30)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    head, port = start_head(temp_dir)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "PYTHONUNBUFFERED": "1",
    }
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for tier in (True, False):
                    name = f"kill{r}{'tier' if tier else 'storage'}"
                    row = one(tier, name, Path(tmp), args.kill_at, head.pid, env)
                    rows.append(row)
                    print(row, flush=True)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()}")
    print(
        f"\n{'restore':<8} {'killed at':>9} {'restored':>8} {'from':>7} {'first step s':>12} "
        f"{'back to step s':>14}"
    )
    for row in rows:
        print(
            f"{'memory' if row['tier'] else 'storage':<8} {row['killed_at']:>9} "
            f"{row['restored']:>8} {row['from']:>7} {row['first_step_s']:>12.1f} "
            f"{row['back_to_step_s']:>14.1f}"
        )
    tier = statistics.median(r["back_to_step_s"] for r in rows if r["tier"])
    plain = statistics.median(r["back_to_step_s"] for r in rows if not r["tier"])
    print(f"\nback-to-step driver-kill tier/no-tier = {tier / plain:.2f}")


if __name__ == "__main__":
    main()
