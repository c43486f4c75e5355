"""The soak: one long run of the digits job on a simulated 3-node cluster under every failure
kind ftjob simulates, then the proof that nothing was lost.

The soak starts a simulated cluster in its own process (``ray.cluster_utils.Cluster``: a head
with no CPUs and three 1-CPU nodes, Ray's health checks as ftjob sets them) and stands in for
its autoscaler: a node that dies is replaced after ``--replace-delay`` seconds. On it, one run
(``name=soak``) is trained by a chain of drivers, each started with the *same* command --
``resume=auto``, as a scheduler reruns it:

- ``chaos=mixed`` with kills at fixed steps (``chaos.at_steps``, spread evenly over the run):
  worker SIGKILLs, node kills, preemptions with notice, hangs (SIGSTOP: found by hang
  detection), stragglers (a rank slowed), in turn; a continued run skips the kills its earlier
  driver had passed;
- storage faults: a share of the checkpoint requests fail with 503 SlowDown (retried);
- driver deaths: at chosen steps the soak SIGKILLs the driver, then runs the same command;
- a zombie driver: at chosen steps the soak freezes the driver (SIGSTOP) past its lease,
  starts the same command (which takes the run over), and thaws the frozen one once the new
  driver trains: it must stop without writing anything.

Then, against an unkilled run of the same config on the same cluster (the reference):
the final weights bit for bit; every step of the run trained the global batch the data order
gives it, each once (the drivers' ``audit_batches`` joined, every sample of every epoch exactly
once); every committed checkpoint verifies and none was quarantined; the run's outputs in its
storage are the last driver's; no output holds the planted secret (a worker environment
variable). The table: failures by kind, time to recover per kind, goodput (ETTR) over the
whole soak, drivers included; ``soak_timeline.png`` draws it.

    python benchmarks/soak.py [--failures 100] [--out DIR]           # ~45 min on 2 cores
    python benchmarks/soak.py --failures 12 --epochs 6                # a short one (~8 min)
    python benchmarks/soak.py --variant elastic   # trainer.exact=true, min_workers=1: shrinks
                                                  # and grows (node replacements held back)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ftjob from this tree, as the drivers (started in its root) and their workers import it: the
# report must read their records with their code, not an installed copy's.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROGRESS = re.compile(r" step (\d+)/(\d+) ")
# The console's chaos lines (ftjob.chaos.schedule.describe_chaos), by kind.
CHAOS_LINES = {
    "worker": re.compile(r"chaos: kill \d+: worker"),
    "node": re.compile(r"chaos: killing node"),
    "preempt": re.compile(r"chaos: preempting node"),
    "hang": re.compile(r"chaos: hang \d+:"),
    "slow": re.compile(r"chaos: slow \d+:"),
}
# A failure record's kind (ftjob.reporting.failures) -> the chaos kind behind it.
FAILURE_KINDS = {"worker_kill": "worker", "node_kill": "node", "preemption": "preempt"}
DIGITS_TRAIN_STEPS_PER_EPOCH = 22  # 1,437 training images in global batches of 64


class DriverLog:
    """What one driver of the run left: its console lines (``console.txt``), when it started
    and ended (``meta.json``), and its summary.json if it wrote one."""

    def __init__(self, index: int, run_dir: Path) -> None:
        self.index, self.run_dir = index, run_dir
        self.lines: list[str] = []
        self.started = time.time()
        self.ended: float | None = None

    @classmethod
    def load(cls, run_dir: Path) -> DriverLog:
        """A driver of an earlier soak, from its run dir (``--report-only``)."""
        meta = json.loads((run_dir / "meta.json").read_text())
        log = cls(meta["index"], run_dir)
        log.started, log.ended = meta["started"], meta["ended"]
        log.lines = (run_dir / "console.txt").read_text().splitlines(keepends=True)
        return log

    def chaos_kills(self) -> dict[str, int]:
        return {k: sum(bool(p.search(line)) for line in self.lines) for k, p in CHAOS_LINES.items()}

    def summary(self) -> dict[str, Any] | None:
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def record(self) -> dict[str, Any] | None:
        """Its summary, or one rebuilt from the record it kept in its run dir (a driver that
        did not end: ``python -m ftjob.report RUN_DIR`` rebuilds the same)."""
        from ftjob.reporting.run_record import read_record, rebuilt_summary

        if (summary := self.summary()) is not None:
            return summary
        kept = read_record(str(self.run_dir))
        return rebuilt_summary(kept).document() if kept is not None else None


class Driver(DriverLog):
    """A driver of the run running: ``python -m ftjob`` in a process of its own, its console
    read on a thread and its latest progress step tracked."""

    def __init__(self, index: int, args: list[str], run_dir: Path, env: dict[str, str]) -> None:
        super().__init__(index, run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.run_dir / "console.txt", "w") as log:
            for line in self.proc.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()
                if m := PROGRESS.search(line):
                    self.step = max(self.step, int(m[1]))
        self.ended = time.time()
        meta = {"index": self.index, "started": self.started, "ended": self.ended}
        (self.run_dir / "meta.json").write_text(json.dumps(meta))

    def took_over(self) -> bool:
        """Has it said it took the run over from a driver whose lease expired?"""
        return any("took over run" in line for line in self.lines)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return code


class SoakCluster:
    """The simulated cluster and its stand-in autoscaler: every dead node is replaced by a new
    1-CPU node ``replace_delay`` seconds after the soak first sees it dead."""

    def __init__(self, nodes: int, replace_delay: float) -> None:
        # Token authentication, as `ray start` clusters have it and as ftjob's drivers use it
        # on a machine with a Ray token: a cluster and a driver that differ cannot talk.
        os.environ["RAY_AUTH_MODE"] = "token"
        import ray

        from ftjob.config import RayConfig
        from ftjob.driver.cluster import LocalCluster, system_config

        self.local = LocalCluster(nodes + 1, 1, 0.0, system_config=system_config(RayConfig()))
        self.nodes, self.replace_delay = nodes, replace_delay
        self.dead_since: dict[str, float] = {}
        self.replaced = 0
        ray.init(address=self.local.address, logging_level="ERROR", log_to_driver=False)

    @property
    def address(self) -> str:
        return self.local.address

    def service(self) -> None:
        """Called from the main thread (``Cluster.add_node`` needs it)."""
        import ray

        now = time.monotonic()
        workers = [n for n in ray.nodes() if n["Resources"].get("CPU", 0) > 0 or not n["Alive"]]
        alive = sum(1 for n in workers if n["Alive"])
        for n in workers:
            if not n["Alive"]:
                self.dead_since.setdefault(n["NodeID"], now)
        due = [k for k, t in self.dead_since.items() if now - t >= self.replace_delay]
        for node in due[: max(0, self.nodes - alive)]:
            self.local.cluster.add_node(num_cpus=1)
            self.dead_since[node] = float("inf")  # replaced: never again
            self.replaced += 1
            alive += 1

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.local.shutdown()


@dataclass
class Soak:
    out: Path
    address: str
    epochs: int
    failures: int
    variant: str
    secret: str = field(default_factory=lambda: "soak-" + secrets.token_hex(12))
    at_least: int = 100  # injected failures the soak must reach (kills, drivers)

    @property
    def storage(self) -> Path:
        return self.out / "storage"

    def command(self, name: str, chaos: bool) -> list[str]:
        total = self.epochs * DIGITS_TRAIN_STEPS_PER_EPOCH
        args = [
            "+experiment=digits_ft",
            f"name={name}",
            "resume=auto",
            f"trainer.epochs={self.epochs}",
            "trainer.audit_samples=true",
            "trainer.decode_in=worker",
            f"checkpoint.storage_path={self.storage}",
            "checkpoint.shared_filesystem=true",
            "checkpoint.lease_timeout=15",
            f"ray.address={self.address}",
            "failure.max_failures=-1",
            "failure.hang.min_timeout=10",
            f"+ray.runtime_env.env_vars.SOAK_API_TOKEN={self.secret}",
        ]
        if self.variant == "elastic":
            args += ["trainer.min_workers=1", "trainer.exact=true", "trainer.resize_interval=5"]
        if not chaos:
            return args
        # Kills spread over the run, leaving its first and last epochs alone; hangs and slow
        # ranks in the mix (a hang costs hang detection's timeout).
        first, last = DIGITS_TRAIN_STEPS_PER_EPOCH, total - DIGITS_TRAIN_STEPS_PER_EPOCH
        every = max(2, (last - first) // self.failures)
        at = list(range(first, last, every))[: self.failures]
        mix = "[worker,node,preempt,hang,slow]" if self.variant == "fixed" else "[node,worker]"
        return args + [
            "chaos=mixed",
            f"chaos.mix={mix}",
            f"chaos.at_steps=[{','.join(map(str, at))}]",
            "chaos.notice=5",
            "chaos.slowdown=0.3",
            "chaos.allow_on_existing_cluster=true",
            "chaos.storage.failure_rate=0.1",
            "chaos.storage.errors=[throttle]",
        ]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_to_end(driver: Driver, cluster: SoakCluster, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while driver.proc.poll() is None:
        if time.monotonic() > deadline:
            driver.signal(signal.SIGKILL)
            raise RuntimeError(f"driver {driver.index} did not finish in {timeout:.0f} s")
        cluster.service()
        time.sleep(1.0)
    return driver.wait(60)


def serve_until(cluster: SoakCluster, done: Any, timeout: float) -> bool:
    """The autoscaler's loop until ``done()`` or ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        cluster.service()
        time.sleep(0.5)
    return True


def driver_events(total: int, count: int) -> list[tuple[int, str]]:
    """Steps at which the soak ends a driver, alternating a SIGKILL and a freeze."""
    return [
        (total * (k + 1) // (count + 1), "kill" if k % 2 == 0 else "freeze") for k in range(count)
    ]


def soak_run(soak: Soak, cluster: SoakCluster, events: list[tuple[int, str]]) -> list[Driver]:
    drivers: list[Driver] = []
    env = soak.env()

    def start() -> Driver:
        d = Driver(
            len(drivers), soak.command("soak", True), soak.out / f"driver{len(drivers)}", env
        )
        drivers.append(d)
        print(f"[soak] driver {d.index} started (pid {d.proc.pid})", flush=True)
        return d

    current = start()
    for step, how in events:
        if not serve_until(
            cluster, lambda d=current, s=step: d.step >= s or d.proc.poll() is not None, 3600
        ):
            raise RuntimeError(f"driver {current.index} never reached step {step}")
        if current.proc.poll() is not None:
            raise RuntimeError(f"driver {current.index} ended before step {step}")
        if how == "kill":
            print(f"[soak] step {current.step}: SIGKILL of driver {current.index}", flush=True)
            current.signal(signal.SIGKILL)
            current.wait(60)
            current = start()
            continue
        frozen = current
        print(f"[soak] step {frozen.step}: driver {frozen.index} frozen (SIGSTOP)", flush=True)
        frozen.signal(signal.SIGSTOP)
        # The same command takes the run over once the frozen driver's lease has expired. It
        # cannot train before the frozen one thaws: the frozen job holds its workers' CPUs
        # (and a restarted worker of it waits for its train function, which the frozen
        # process owns) -- as a frozen VM's job would until Ray saw its driver go.
        current = start()
        if not serve_until(
            cluster, lambda d=current: d.took_over() or d.proc.poll() is not None, 600
        ):
            raise RuntimeError(f"driver {current.index} did not take the run over")
        print(f"[soak] driver {current.index} took the run over; driver {frozen.index} thawed")
        frozen.signal(signal.SIGCONT)
        serve_until(cluster, lambda d=frozen: d.proc.poll() is not None, 300)
        code = frozen.wait(60)
        print(f"[soak] thawed driver {frozen.index} ended with {code}", flush=True)
    code = run_to_end(current, cluster, 7200)
    print(f"[soak] driver {current.index} ended with {code}", flush=True)
    return drivers


def final_weights(summary: dict[str, Any]) -> dict[str, Any]:
    """The model of a finished run's newest committed checkpoint."""
    import io

    import torch

    from ftjob.storage.checkpoint import checkpoint_file

    data = checkpoint_file(summary["checkpoints"]["latest"], "model.pt")
    return torch.load(io.BytesIO(data), weights_only=True)


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The names of the tensors that differ in any bit (or are missing on one side)."""
    import torch

    differ = sorted(set(a) ^ set(b))
    return differ + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def joined_audit(summaries: list[dict[str, Any]]) -> dict[int, str]:
    """``step -> digest of its global batch`` over every driver, in the order they ran: each
    driver's steps that its final state kept, a later driver's version of a step replacing an
    earlier one's (it continued from before that step: its version is the final model's)."""
    steps: dict[int, str] = {}
    for summary in summaries:
        for step, digest in summary.get("audit_batches", []):
            steps[int(step)] = digest
    return steps


def checkpoint_checks(run_path: Path) -> tuple[list[int], list[str], list[dict[str, Any]]]:
    """Every committed checkpoint of the run downloaded and checked against its manifest's
    sizes and SHA-256 digests: (committed steps, those that do not verify and why, the notes
    of what was quarantined)."""
    import fsspec

    from ftjob.storage.checkpoint import QUARANTINE_NOTE, CheckpointStore
    from ftjob.storage.manifest import CorruptCheckpoint

    store = CheckpointStore(fsspec.filesystem("file"), str(run_path))
    committed, bad = store.committed_steps(), []
    with tempfile.TemporaryDirectory() as tmp:
        for step in committed:
            try:
                store.download(step, os.path.join(tmp, str(step)))
            except CorruptCheckpoint as exc:
                bad.append(f"step {step}: {exc}")
    notes = [
        json.loads(p.read_text()) for p in Path(store.quarantine_root).glob(f"*/{QUARANTINE_NOTE}")
    ]
    return committed, bad, notes


def unrecorded_steps(drivers: list[DriverLog]) -> set[int]:
    """Steps a driver killed outright (no summary) cannot have audited: past the last step of
    its record and up to where the next driver continued -- its workers train on for a moment
    after it dies, until Ray ends them, and the next driver restores what they left."""
    steps: set[int] = set()
    for d, nxt in zip(drivers, drivers[1:], strict=False):
        if d.summary() is not None:
            continue
        mine = [int(s) for s, _ in (d.record() or {}).get("audit_batches", [])]
        theirs = [int(s) for s, _ in (nxt.record() or {}).get("audit_batches", [])]
        if theirs:
            steps.update(range(max(mine, default=0) + 1, min(theirs)))
    return steps


def secrets_found(root: Path, secret: str) -> list[str]:
    """Files under ``root`` whose bytes hold ``secret``."""
    needle = secret.encode()
    found = []
    for path in root.rglob("*"):
        if path.name == "soak.json":  # the soak's own record of what it planted
            continue
        if path.is_file() and needle in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return found


CLOCK = re.compile(r"^\[ftjob\] (\d+):(\d\d) (.*)$")


def events(d: DriverLog) -> list[tuple[float, str]]:
    """(wall time, line) of a driver's timed console lines (its ``mm:ss`` since it started)."""
    out = []
    for line in d.lines:
        if m := CLOCK.match(line.strip()):
            out.append((d.started + int(m[1]) * 60 + int(m[2]), m[3]))
    return out


def draw_timeline(drivers: list[DriverLog], start: float, path: Path) -> None:
    """The soak in time: each driver's life, its training steps, and every chaos event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lives, steps) = plt.subplots(2, 1, figsize=(14, 6), sharex=True, height_ratios=[1, 2])
    colours = {"worker": "C3", "node": "C1", "preempt": "C2", "hang": "C4", "slow": "C5"}
    for d in drivers:
        end = (d.ended or time.time()) - start
        lives.barh(d.index, end - (d.started - start), left=d.started - start, color="C0")
        points = [(t - start, int(m[1])) for t, line in events(d) if (m := PROGRESS.search(line))]
        if points:
            steps.plot(*zip(*points, strict=True), ".", color="C0", markersize=3)
        for t, line in events(d):
            for kind, pattern in CHAOS_LINES.items():
                if pattern.search("chaos: " + line.removeprefix("chaos: ")):
                    steps.axvline(t - start, color=colours[kind], alpha=0.5, linewidth=0.8)
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in colours.items()]
    steps.legend(handles=handles, loc="upper left", fontsize=8)
    lives.set_ylabel("driver")
    steps.set_ylabel("step")
    steps.set_xlabel("seconds since the soak started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def kind_table(drivers: list[DriverLog]) -> dict[str, dict[str, Any]]:
    """Injected failures by kind (the drivers' consoles: a killed driver leaves no summary)
    and time to recover per kind (the summaries' failure records)."""
    table: dict[str, dict[str, Any]] = {}
    for d in drivers:
        for kind, count in d.chaos_kills().items():
            table.setdefault(kind, {"injected": 0, "ttr": []})["injected"] += count
        for f in (d.record() or {}).get("failures", []):
            if f.get("time_to_recover_s") is not None:
                kind = FAILURE_KINDS.get(f["kind"], f["kind"])
                table.setdefault(kind, {"injected": 0, "ttr": []})["ttr"].append(
                    f["time_to_recover_s"]
                )
    return table


def report(
    soak: Soak, ref: DriverLog, drivers: list[DriverLog], wall: float, replaced: int
) -> bool:
    """Prints the table and the checks; True when every check holds."""
    reference = ref.summary()
    summaries = [s for d in drivers if (s := d.record()) is not None]
    last = drivers[-1].summary()
    checks: dict[str, bool] = {}
    checks["the last driver succeeded"] = last is not None and last["status"] == "succeeded"
    assert reference is not None
    if last is not None and checks["the last driver succeeded"]:
        differ = same_weights(final_weights(reference), final_weights(last))
        checks[
            f"final weights bit-identical to the unkilled run ({len(differ)} differ)"
        ] = not differ
    # The reference trained every sample of every epoch once (its own audit), in the global
    # batches the data order gives each step: the soak's final model holds every sample of
    # every epoch exactly once when its drivers' surviving steps are exactly those batches.
    ref_batches = {int(s): d for s, d in reference.get("audit_batches", [])}
    ref_clean = all(not (a["duplicates"] or a["missing"]) for a in reference.get("audit", []))
    joined = joined_audit(summaries)
    after_death = unrecorded_steps(drivers)
    wrong = [s for s in ref_batches if s in joined and joined[s] != ref_batches[s]]
    missing = [s for s in ref_batches if s not in joined and s not in after_death]
    checks[
        f"every step trained the data order's global batch, each sample of each epoch once "
        f"({len(joined)} of {len(ref_batches)} steps audited across the drivers; "
        f"{len(wrong)} on another batch, {len(missing)} missing)"
    ] = ref_clean and bool(ref_batches) and not wrong and not missing
    unaudited = sorted(set(after_death) & set(ref_batches) - set(joined))
    print(
        f"[soak] {len(unaudited)} step(s) trained by a SIGKILLed driver's workers after its last "
        f"record, before Ray ended them (no ledger was there to audit them; the weights' bits "
        f"cover them): {unaudited}"
    )
    committed, bad, quarantined = checkpoint_checks(soak.storage / "soak")
    checks[
        f"every committed checkpoint verifies ({len(committed)} committed, {len(bad)} do not)"
    ] = bool(committed) and not bad
    # Set aside and not damaged: a deposed driver's commit left behind, an upload a kill cut
    # short (never committed: no manifest). Damaged: a committed checkpoint that went bad.
    corrupt = [
        q
        for q in quarantined
        if q.get("committed", True) and "left behind" not in str(q.get("reason", ""))
    ]
    for q in quarantined:
        print(f"[soak] set aside: step {q.get('step')}: {q.get('reason')}")
    checks[
        f"nothing quarantined as damaged ({len(quarantined)} set aside, {len(corrupt)} damaged)"
    ] = not corrupt
    outputs = soak.storage / "soak" / "outputs" / "summary.json"
    copied = json.loads(outputs.read_text()) if outputs.exists() else {}
    checks["the run's outputs in storage are the last driver's summary"] = (
        last is not None and copied.get("timing") == last.get("timing")
    )
    leaked = secrets_found(soak.out, soak.secret)
    checks[f"no output holds the secret ({len(leaked)} files do)"] = not leaked
    table = kind_table(drivers)
    times = [t for row in table.values() for t in row["ttr"]]
    checks[
        f"every recovery's time, origin to first step, is positive (shortest {min(times, default=0):.1f} s)"
    ] = bool(times) and all(t > 0 for t in times)
    killed = sum(1 for d in drivers if d.summary() is None)
    thawed = sum(1 for d in drivers[:-1] if d.summary() is not None)
    injected = sum(row["injected"] for row in table.values()) + killed + thawed
    checks[f">= {soak.at_least} injected failures ({injected})"] = injected >= soak.at_least
    print(f"\n[soak] {len(drivers)} drivers, {wall:.0f} s, {replaced} nodes replaced")
    print(f"{'kind':<14} {'injected':>8} {'recovered':>9} {'TTR mean s':>10} {'TTR max s':>9}")
    for kind, row in sorted(table.items()):
        ttr = row["ttr"]
        mean = f"{statistics.fmean(ttr):.1f}" if ttr else "-"
        top = f"{max(ttr):.1f}" if ttr else "-"
        recovered = "-" if kind == "slow" else len(ttr)  # a slow rank is no failure itself
        print(f"{kind:<14} {row['injected']:>8} {recovered:>9} {mean:>10} {top:>9}")
    print(f"{'driver kill':<14} {killed:>8}")
    print(f"{'driver freeze':<14} {thawed:>8}")
    totals = [s.get("storage", {}).get("total", {}) for s in summaries]
    retried = sum(t.get("retries", 0) for t in totals)
    failed = sum(t.get("failures", 0) for t in totals)
    print(
        f"storage: {retried} injected 503s retried, {failed} requests failed, over "
        f"{sum(t.get('calls', 0) for t in totals)} requests the drivers' records counted"
    )
    trained = sum(s["goodput"]["buckets"].get("training", 0.0) for s in summaries)
    print(
        f"goodput: training {trained:.0f} s of the soak's {wall:.0f} s (ETTR {trained / wall:.3f})"
    )
    draw_timeline(drivers, drivers[0].started, soak.out / "soak_timeline.png")
    print(f"timeline: {soak.out / 'soak_timeline.png'}")
    ok = all(checks.values())
    for what, holds in checks.items():
        print(f"  [{'ok' if holds else 'FAILED'}] {what}")
    return ok


def report_only(out: Path) -> bool:
    """The report of an earlier soak, from what it left in ``out``."""
    saved = json.loads((out / "soak.json").read_text())
    soak = Soak(out, "", saved["epochs"], saved["failures"], saved["variant"], saved["secret"])
    soak.at_least = saved.get("at_least", soak.at_least)
    drivers = [
        DriverLog.load(d) for d in sorted(out.glob("driver*"), key=lambda p: int(p.name[6:]))
    ]
    return report(
        soak, DriverLog.load(out / "reference"), drivers, saved["wall"], saved["replaced"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=110, help="chaos kills at steps")
    parser.add_argument(
        "--at-least", type=int, default=100, help="injected failures the soak must reach"
    )
    parser.add_argument("--epochs", type=int, default=0, help="0: enough for the failures")
    parser.add_argument("--driver-events", type=int, default=4, help="driver kills + freezes")
    parser.add_argument("--variant", choices=["fixed", "elastic"], default="fixed")
    parser.add_argument("--replace-delay", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report-only", type=Path, default=None, help="an earlier soak's --out")
    args = parser.parse_args()
    if args.report_only is not None:
        sys.exit(0 if report_only(args.report_only) else 1)
    epochs = args.epochs or max(8, -(-args.failures * 6 // DIGITS_TRAIN_STEPS_PER_EPOCH) + 2)
    out = args.out or Path(tempfile.mkdtemp(prefix="ftjob-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"[soak] load {os.getloadavg()}; out {out}; epochs {epochs}", flush=True)
    delay = args.replace_delay if args.variant == "fixed" else max(args.replace_delay, 20.0)
    cluster = SoakCluster(3, delay)
    started = time.time()
    try:
        soak = Soak(out, cluster.address, epochs, args.failures, args.variant)
        soak.at_least = args.at_least
        ref = Driver(0, soak.command("reference", False), out / "reference", soak.env())
        if run_to_end(ref, cluster, 3600) != 0:
            raise RuntimeError("the reference run failed: see " + str(ref.run_dir))
        soak_started = time.time()
        total = epochs * DIGITS_TRAIN_STEPS_PER_EPOCH
        drivers: list[DriverLog] = list(
            soak_run(soak, cluster, driver_events(total, args.driver_events))
        )
        saved = {
            "epochs": epochs,
            "failures": args.failures,
            "at_least": args.at_least,
            "variant": args.variant,
            "secret": soak.secret,  # the planted one: the report looks for it in every output
            "wall": time.time() - soak_started,
            "replaced": cluster.replaced,
        }
        (out / "soak.json").write_text(json.dumps(saved))
        ok = report(soak, ref, drivers, saved["wall"], cluster.replaced)
    finally:
        cluster.shutdown()
        print(f"[soak] {time.time() - started:.0f} s in all; load {os.getloadavg()}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
