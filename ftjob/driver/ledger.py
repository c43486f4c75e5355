"""The run ledger: a Ray actor on the driver's node that records what happens to a run.

Workers, the chaos killer and the Ray Train controller send it events (attempt starts, restore
timings, first step after a restore, validations, checkpoints, kills, failures). It lives
outside the training workers and outside the model checkpoint, so recovery records survive any
number of kills -- including kills that land while a worker is still restoring. The driver
polls it for progress lines and builds summary.json from :meth:`RunLedger.snapshot`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from ftjob.chaos.schedule import describe_chaos
from ftjob.config import NODE_KINDS
from ftjob.driver.drains import DrainRelay
from ftjob.metrics import fmt, json_safe
from ftjob.policy.hang import HangPolicy, RunWatch, WatchConfig, restart_loop
from ftjob.reporting.resizes import describe_restart
from ftjob.worker.preemption import DRIVER, RESIZE, describe_notice


class ChaosRecords:
    """The run ledger's chaos part: the training workers chaos may hit, and every kill, skipped
    window and injected failure. State lives in :class:`RunLedger` (its one ``__init__``)."""

    attempts: list[dict[str, Any]]
    kills: list[dict[str, Any]]
    pending_kills: list[dict[str, Any]]
    skipped_kills: list[dict[str, Any]]
    injected: list[dict[str, Any]]
    pending_failures: set[int]
    trained_all: bool
    finished: float | None
    watch: RunWatch

    def log(self, line: str) -> None:
        raise NotImplementedError

    def workers(self) -> list[dict[str, Any]]:
        """Training workers of the latest attempt (for the chaos killer's targets)."""
        if not self.attempts:
            return []
        return [dict(w, rank=r) for r, w in sorted(self.attempts[-1]["workers"].items())]

    def chaos_view(self) -> dict[str, Any]:
        """What the chaos killer needs: when training began, and the current attempt."""
        if not self.attempts:
            return {
                "training_started": None,
                "attempt": None,
                "training": False,
                "workers": [],
                "step": 0,
            }
        first = self.attempts[0]["first_step"]
        latest = self.attempts[-1]
        return {
            "training_started": first["time"] if first else None,
            "attempt": latest["index"],
            "training": latest["first_step"] is not None
            and not self.trained_all
            and self.finished is None,
            "workers": self.workers(),
            "step": latest["max_step"],
        }

    def claim_injected_failure(self, step: int, now: float) -> bool:
        """True once per step in chaos.fail_at_steps: that worker then raises."""
        if step not in self.pending_failures:
            return False
        self.pending_failures.discard(step)
        self.injected.append({"time": now, "step": step})
        self.log(f"chaos: injected failure at step {step}")
        return True

    def kill(self, record: dict[str, Any]) -> None:
        """A chaos event the killer carried out. A node kill counts once confirmed (the node
        is gone: :meth:`confirm_kill`); until then it is pending, though a simulated cluster
        already replaces the node. ``slow`` makes a rank sleep in every step (its heartbeat
        learns it)."""
        pending = record["kind"] in NODE_KINDS
        entry = dict(record, confirmed=not pending)
        (self.pending_kills if pending else self.kills).append(entry)
        if record["kind"] == "slow":
            rank, fraction = record["target"]["rank"], record["slowdown"]
            self.watch.slow = {"attempt": record["attempt"], "rank": rank, "fraction": fraction}
        self.log(describe_chaos(record, len(self.kills)))

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        entry = next((k for k in self.pending_kills if k["time"] == time_of_kill), None)
        if entry is None:
            return
        self.pending_kills.remove(entry)
        target = entry.get("target", {})
        what = f"node {target.get('node_id', '?')[:12]} (ranks {target.get('ranks')})"
        if confirmed:
            self.kills.append(dict(entry, confirmed=True))
            self.kills.sort(key=lambda k: k["time"])
            self.log(f"chaos: kill {len(self.kills)}: {what} is gone")
        else:
            self.chaos_skipped(dict(entry, reason="the node was not confirmed dead"))

    def chaos_skipped(self, record: dict[str, Any]) -> None:
        """A kill window that ended without a kill, and why."""
        self.skipped_kills.append(record)
        self.log(f"chaos: no {record['kind']} kill: {record['reason']}")

    def snapshot_kills(self) -> list[dict[str, Any]]:
        """Every kill carried out, pending node kills included (to replace their nodes)."""
        return sorted(self.kills + self.pending_kills, key=lambda k: k["time"])


class ElasticRecords:
    """The run ledger's elastic part: a planned resize of the running group, from the scaling
    policy's request through the workers' checkpoint to the resize it carried out."""

    attempts: list[dict[str, Any]]
    stop_request: dict[str, Any] | None
    resize_request: dict[str, Any] | None
    resize_said: tuple[int, int] | None
    executed_resizes: list[float]

    def log(self, line: str) -> None:
        raise NotImplementedError

    def request_resize(self, current: int, target: int, now: float) -> None:
        """The elastic scaling policy will resize the running group: the workers first commit a
        checkpoint of their current step (the preemption path), so the resize loses nothing."""
        if self.resize_request is None:
            self.resize_request = {"from": current, "to": target, "requested": now}
            if self.resize_said != (current, target):  # the policy asks again until served
                self.resize_said = (current, target)
                self.log(f"capacity for {target} workers (running on {current}): resizing")

    def notice_request(self) -> str | None:
        """What rank 0's notice poller acts on: a stop (SIGTERM to the driver), a resize."""
        if self.stop_request is not None:
            return DRIVER
        return RESIZE if self.resize_request is not None else None

    def resize_executed(self, now: float) -> None:
        """The scaling policy handed Ray Train a resize of the running group."""
        self.executed_resizes.append(now)
        self.resize_request = None  # served; a later request is a new one, and is said
        self.resize_said = None

    def resize_checkpointed(self) -> bool:
        """The latest attempt committed (or tried to) its checkpoint for the resize asked now
        (not for an earlier one, whose record the previous group's attempt still holds)."""
        latest = self.attempts[-1] if self.attempts else None
        record, asked = (latest or {}).get("resize"), self.resize_request
        return (
            bool(record and asked and record.get("requested") == asked["requested"])
            and "jit" in record
        )


def _audit_entry() -> dict[str, Any]:
    return {"ids": [], "skipped": []}


class SampleRecords:
    """The run ledger's data part: the sample audit (``trainer.audit_samples``: every step's
    samples, from every rank) and the files skipped as bad (``dataset.bad_files=skip``)."""

    audit: dict[tuple[int, int], dict[str, Any]]
    bad_files: dict[tuple[str, int], dict[str, Any]]

    def log(self, line: str) -> None:
        raise NotImplementedError

    def audit_step(
        self, attempt: int, step: int, epoch: int, ids: list[int], skipped: list[int] | None = None
    ) -> None:
        """A rank's slice of a step: its samples, and those of them skipped (bad files)."""
        entry = self.audit[(attempt, step)]
        entry["epoch"] = epoch
        entry["ids"].extend(ids)
        entry["skipped"].extend(skipped or [])

    def skipped_files(self, attempt: int, rank: int, records: list[dict[str, Any]]) -> None:
        """Files a rank skipped: split, id, path, reason; each said once for the run."""
        for record in records:
            key = (record["split"], int(record["id"]))
            if key in self.bad_files:
                continue
            self.bad_files[key] = {**record, "attempt": attempt, "rank": rank}
            self.log(
                f"data: skipped {record['split']} file {record['path']} ({record['reason']}); "
                "dataset.bad_files=skip leaves it out of every epoch"
            )

    def sample_records(self) -> dict[str, Any]:
        return {
            "audit": [
                {"attempt": a, "step": s, "epoch": e["epoch"], "ids": e["ids"]}
                | ({"skipped": e["skipped"]} if e["skipped"] else {})
                for (a, s), e in sorted(self.audit.items())
            ],
            "skipped_files": [self.bad_files[k] for k in sorted(self.bad_files)],
        }


class RunLedger(ChaosRecords, ElasticRecords, SampleRecords):
    """Plain class; :func:`start_ledger` runs it as a Ray actor."""

    def __init__(
        self,
        plan: dict[str, Any],
        fail_at_steps: list[int] | None = None,
        watch: WatchConfig | None = None,
    ) -> None:
        self.plan = dict(plan)
        self.watch = RunWatch(watch or WatchConfig(HangPolicy()))
        self.started = time.time()
        self.attempts: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []  # confirmed kills
        self.pending_kills: list[dict[str, Any]] = []  # node kills not yet confirmed
        self.skipped_kills: list[dict[str, Any]] = []
        self.injected: list[dict[str, Any]] = []
        self.validations: dict[int, dict[str, Any]] = {}
        self.replaced_validations = 0
        self.checkpoints: list[dict[str, Any]] = []
        self.storage: dict[str, dict[str, Any]] = {}
        self.audit: dict[tuple[int, int], dict[str, Any]] = defaultdict(_audit_entry)
        self.bad_files: dict[tuple[str, int], dict[str, Any]] = {}  # (split, id) -> record
        self.metrics: dict[str, float] = {}
        self.progress: dict[str, Any] = {}
        self.fatal: str | None = None
        self.stop_request: dict[str, Any] | None = None
        self.resize_request: dict[str, Any] | None = None
        self.executed_resizes: list[float] = []
        self.resize_said: tuple[int, int] | None = None
        self.finished: float | None = None
        self.pending_failures = set(fail_at_steps or [])
        self.trained_all = False  # the last step is done: nothing left for chaos to interrupt
        self.lines: list[str] = []
        self.step_records: list[dict[str, Any]] = []  # for the experiment loggers, append-only
        self.history: dict[int, dict[str, Any]] = {}  # step -> its progress point that survived
        self.drains: DrainRelay | None = (
            None  # in this process for the whole run (ftjob.driver.drains)
        )

    def log(self, line: str) -> None:
        """A progress line for the driver to print."""
        self.lines.append(line)

    # -- attempts ---------------------------------------------------------------------------

    def begin_attempt(self, now: float, world: int | None = None) -> int:
        index = len(self.attempts)
        previous = self.attempts[-1] if self.attempts else None
        self.attempts.append(
            {
                "index": index,
                "started": now,
                "world_size": world,
                "workers": {},
                "restored": None,
                "preemption": None,
                "resize": None,
                "first_step": None,
                "max_step": 0,
            }
        )
        self.resize_request = None  # served: this is the resized group
        if index:
            before = previous["world_size"] if previous else None
            most = self.plan.get("num_workers")
            self.log(f"attempt {index + 1}: {describe_restart(before, world, most)}")
        return index

    def start_attempt(self, now: float, world: int | None = None) -> dict[str, Any]:
        """Rank 0, first thing: the attempt's index, and why it must not train (the job was
        already stopped by a fatal error -- a data error raised on one rank restarts the group
        once -- or a restart loop: the last attempts all failed without progress)."""
        index = self.begin_attempt(now, world)
        c = self.watch.config
        stop = self.fatal or restart_loop(
            self.attempts, c.restart_loop_attempts, c.restart_loop_min_steps
        )
        if stop:
            self.set_fatal(stop)
        return {"attempt": index, "stop": stop}

    def register_worker(self, attempt: int, rank: int, info: dict[str, Any]) -> None:
        self.attempts[attempt]["workers"][rank] = info
        self.watch.register(attempt, rank, info, info.get("time", time.time()))

    def heartbeat(self, attempt: int, rank: int, beat: dict[str, Any]) -> dict[str, Any]:
        """A rank's progress (about once a second); the answer steers chaos=slow."""
        return self.watch.beat(attempt, rank, beat, time.time())

    def check_watch(self, now: float) -> list[dict[str, Any]]:
        """The driver, every poll: a hang or a straggler to act on (see ftjob.policy.hang)."""
        latest = self.attempts[-1] if self.attempts else None
        quiet = self.finished or self.fatal or self.stop_request
        if latest is None or latest["preemption"] or latest.get("resize") or quiet:
            return []
        if self.failures and self.failures[-1]["noticed"] >= latest["started"]:
            return []  # Ray Train is restarting the group: its workers are gone, not hung
        actions, lines = self.watch.check(now)
        self.lines.extend(lines)
        return actions

    def hang_handled(self, time_of_hang: float, result: dict[str, Any]) -> None:
        self.log(self.watch.handled(time_of_hang, result))

    def restored(self, attempt: int, info: dict[str, Any]) -> None:
        self.attempts[attempt]["restored"] = info
        self.attempts[attempt]["max_step"] = max(self.attempts[attempt]["max_step"], info["step"])
        for bad in info.get("skipped", []):
            self.log(f"checkpoint at step {bad['step']} is not usable ({bad['reason']}): fell back")
        self.log(
            f"restored step {info['step']} (epoch {info['epoch']}, sample {info['position']}) from "
            f"{info['path']}: download {info['download']:.2f}s, load {info['load']:.2f}s, "
            f"skip {info['skip']:.3f}s"
        )

    def step_done(self, attempt: int, step: int) -> None:
        """Rank 0 after every step: the exact high-water mark, for lost-work accounting."""
        self.attempts[attempt]["max_step"] = max(self.attempts[attempt]["max_step"], step)
        total = self.plan.get("steps_per_epoch", 0) * self.plan.get("epochs", 0)
        if total and step >= total:
            self.trained_all = True

    def first_step(
        self,
        attempt: int,
        step: int,
        now: float,
        took: float = 0.0,
        phases: dict[str, float] | None = None,
    ) -> None:
        """The attempt's first trained step: when it ended, what it took (its batch wait and
        the step itself, which goodput counts as data wait and training, not set-up), and rank
        0's set-up phases before it."""
        if self.attempts[attempt]["first_step"] is None:
            first = {"step": step, "time": now, "took": took, "phases": phases or {}}
            self.attempts[attempt]["first_step"] = first

    def progress_update(
        self, attempt: int, progress: dict[str, Any], metrics: dict[str, float]
    ) -> None:
        self.progress = dict(progress, attempt=attempt)
        self.metrics = dict(metrics)
        values = {k: progress[k] for k in ("loss", "throughput", "lr") if k in progress}
        self.step_records.append(
            {"kind": "train", "attempt": attempt, "step": progress["step"], "values": values}
        )
        world = self.attempts[attempt].get("world_size")
        point = {"step": progress["step"], "time": progress.get("time"), "attempt": attempt}
        self.history[progress["step"]] = {**point, **values, "world_size": world}
        self.attempts[attempt]["max_step"] = max(
            self.attempts[attempt]["max_step"], progress["step"]
        )
        p = progress
        self.log(
            f"epoch {p['epoch'] + 1}/{p['epochs']} step {p['step']}/{p['total_steps']} "
            f"loss {fmt(p['loss'])} | {fmt(p['throughput'], '.0f')} img/s"
        )

    # -- events -----------------------------------------------------------------------------

    def validation(self, attempt: int, step: int, result: dict[str, Any]) -> None:
        if step in self.validations:
            self.replaced_validations += 1  # the step was trained again after a restore
        self.validations[step] = dict(result, step=step, attempt=attempt)
        values = {"loss": result["loss"], "accuracy": result["accuracy"]}
        self.step_records.append(
            {"kind": "validation", "attempt": attempt, "step": step, "values": values}
        )
        self.log(
            f"validation at step {step}: loss {fmt(result['loss'])}, accuracy {fmt(result['accuracy'])}"
        )

    def checkpoint(self, attempt: int, record: dict[str, Any]) -> None:
        self.checkpoints.append(dict(record, attempt=attempt))
        if record.get("path"):
            self.log(f"checkpoint step {record['step']} committed ({record['seconds']:.2f}s)")
        else:
            self.log(f"checkpoint step {record['step']} upload FAILED: {record.get('error')}")

    def storage_stats(self, source: str, stats: dict[str, Any]) -> None:
        """Cumulative storage counters of one process (a worker of an attempt, the controller)."""
        self.storage[source] = stats

    def failure_noticed(self, now: float, errors: dict[int, str]) -> None:
        self.failures.append({"noticed": now, "errors": errors})
        first = next(iter(errors.values()), "")
        self.log(f"failure noticed ({len(errors)} worker(s)): {first[:200]}")

    def set_fatal(self, error: str) -> None:
        if self.fatal is None:
            self.fatal = error
            self.log(f"fatal: {error}")

    # -- preemption -------------------------------------------------------------------------

    def request_stop(self, reason: str, now: float) -> None:
        """The driver got a notice (SIGTERM): the workers checkpoint their current step.
        Workers already checkpointing for a resize need do nothing else: that checkpoint is
        the notice's."""
        latest = self.attempts[-1] if self.attempts else None
        executed = bool(latest and any(t >= latest["started"] for t in self.executed_resizes))
        if (
            latest is not None
            and latest.get("resize")
            and not latest["preemption"]
            and not executed
        ):
            latest["preemption"] = {**latest.pop("resize"), "source": DRIVER}
            latest["resize"] = None
        if self.stop_request is None:
            self.stop_request = {"reason": reason, "time": now}
            self.log(f"preemption notice ({reason}): checkpointing the current step, then stopping")

    def stop_requested(self) -> bool:
        return self.stop_request is not None

    def watch_drains(
        self, interval: float, nodes: dict[str, list[int]], actors: dict[int, Any]
    ) -> None:
        """Ray Train, per worker group: which ranks run on which node ({} after shutdown)."""
        if self.drains is None:
            self.drains = DrainRelay(interval)
        self.drains.watch(nodes, actors)
        self.drains.start()

    def latest_preemption(self) -> dict[str, Any] | None:
        """The latest attempt's notice and JIT checkpoint record (for the driver's wait)."""
        return self.attempts[-1]["preemption"] if self.attempts else None

    def preemption_notice(self, attempt: int, record: dict[str, Any]) -> None:
        """Rank 0, when every rank agreed on a notice (before the just-in-time checkpoint)."""
        if record["source"] == RESIZE and self.stop_request is not None:
            record = {**record, "source": DRIVER}  # the stop came meanwhile: it is the notice
        if record["source"] == RESIZE:  # planned, not a preemption
            record = {**record, **(self.resize_request or {})}
            self.attempts[attempt]["resize"] = dict(record)
        else:
            self.attempts[attempt]["preemption"] = dict(record)
        self.lines.extend(describe_notice(record))

    def jit_checkpoint(self, attempt: int, record: dict[str, Any]) -> None:
        a = self.attempts[attempt]
        notice = a["resize"] if a.get("resize") else a.setdefault("preemption", {})
        notice["jit"] = dict(record)
        self.lines.extend(describe_notice({"jit": record}))

    def finish(self, now: float) -> None:
        self.finished = now

    # -- reading ----------------------------------------------------------------------------

    def log_feed(self, cursor: int) -> dict[str, Any]:
        """Step records since ``cursor`` for the experiment loggers, and the step up to which
        records are settled (no restore can go back before a committed checkpoint)."""
        committed = [c["step"] for c in self.checkpoints if c.get("path")]
        settled = math.inf if self.finished is not None else max(committed, default=0)
        records = self.step_records[cursor:]
        return {"records": records, "cursor": cursor + len(records), "settled": settled}

    def poll(self, cursor: int) -> tuple[list[str], int]:
        return self.lines[cursor:], len(self.lines)

    def snapshot(self) -> dict[str, Any]:
        return json_safe(
            {
                "plan": self.plan,
                "started": self.started,
                "finished": self.finished,
                "attempts": self.attempts,
                "failures": self.failures,
                "kills": self.kills,
                "chaos_skipped": self.skipped_kills
                + [
                    dict(k, reason="not confirmed dead before the run ended")
                    for k in self.pending_kills
                ],
                "injected": self.injected,
                "validations": [self.validations[s] for s in sorted(self.validations)],
                "replaced_validations": self.replaced_validations,
                "checkpoints": self.checkpoints,
                "storage": self.storage,
                **self.sample_records(),
                "metrics": self.metrics,
                "progress": self.progress,
                "history": [self.history[s] for s in sorted(self.history)],
                "fatal": self.fatal,
                "stop_request": self.stop_request,
                "executed_resizes": self.executed_resizes,
                **self.watch.snapshot(),
            }
        )


class _FailureWatch:
    """Ray Train controller callback: tells the ledger when a worker failure is noticed."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger

    def _send_storage_stats(self, run_context: Any) -> None:
        # The controller's own storage requests (run state, Ray's checkpoint bookkeeping).
        fs = getattr(
            getattr(run_context.run_config.storage_filesystem, "handler", None), "fs", None
        )
        if hasattr(fs, "snapshot_stats"):
            self.ledger.storage_stats.remote("controller", fs.snapshot_stats().as_dict())

    def after_report(self, run_context: Any, metrics: Any, checkpoint: Any) -> None:
        self._send_storage_stats(run_context)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._send_storage_stats(run_context)
        errors = {
            int(
                rank
            ): f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            for rank, e in worker_exceptions.items()
        }
        self.ledger.failure_noticed.remote(time.time(), errors)


def failure_watch(ledger: Any) -> Any:
    from ray.train import UserCallback

    cls = type("FailureWatch", (_FailureWatch, UserCallback), {})
    return cls(ledger)


def start_ledger(plan: dict[str, Any], fail_at_steps: list[int], watch: WatchConfig) -> Any:
    """Start the ledger actor on this (the driver's) node; it never moves off it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_restarts=0)(RunLedger)
    strategy = NodeAffinitySchedulingStrategy(
        node_id=ray.get_runtime_context().get_node_id(), soft=False
    )
    return actor.options(scheduling_strategy=strategy).remote(plan, fail_at_steps, watch)


def empty_snapshot() -> dict[str, Any]:
    """The record of a run that never reached the cluster (or whose ledger was lost)."""
    return RunLedger({}).snapshot()
