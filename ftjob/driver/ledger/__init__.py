"""The run ledger: a Ray actor on the driver's node that records what happens to a run.

Workers, the chaos killer and the Ray Train controller send it events (attempt starts, restore
timings, first step after a restore, validations, checkpoints, kills, failures), each a typed
record of :mod:`ftjob.record`. It lives outside the training workers and outside the model
checkpoint, so recovery records survive any number of kills -- including kills that land while
a worker is still restoring. The driver polls it for progress lines and builds summary.json
from :meth:`RunLedger.snapshot`.

:class:`RunLedger` is the actor's surface and nothing more: it composes the attempts
(:mod:`.attempts`), the training record (:mod:`.steps`), chaos (:mod:`.chaos`), the driver's
requests to the group (:mod:`.elastic`), the sample audit (:mod:`.samples`) and the hang and
straggler watch (:class:`ftjob.policy.hang.RunWatch`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ftjob.actors import Actor, tell
from ftjob.driver.drains import DrainRelay
from ftjob.driver.ledger.attempts import Attempts
from ftjob.driver.ledger.chaos import ChaosLog, chaos_view
from ftjob.driver.ledger.elastic import Requests, ResizeState
from ftjob.driver.ledger.samples import SampleAudit
from ftjob.driver.ledger.steps import StepLog
from ftjob.policy.hang import HangPolicy, RunWatch, SlowRank, WatchConfig, restart_loop
from ftjob.record import (
    AttemptStart,
    Beat,
    ChaosSkip,
    ChaosView,
    CheckpointRecord,
    DecodeChoice,
    Failure,
    FirstStep,
    Hang,
    JitCheckpoint,
    Kill,
    LogFeed,
    Notice,
    NoticeSource,
    Progress,
    RecordPull,
    Restore,
    RunPlan,
    RunSnapshot,
    SkippedFile,
    StackCapture,
    StorageCounters,
    Straggler,
    ValidationResult,
    WorkerLedger,
    WorkerPlace,
)
from ftjob.text import shorten


class RunLedger:
    """Plain class; :func:`start_ledger` runs it as a Ray actor."""

    def __init__(
        self,
        plan: RunPlan,
        fail_at_steps: list[int] | None = None,
        watch: WatchConfig | None = None,
    ) -> None:
        self.plan = plan
        self.started = time.time()
        self.lines: list[str] = []
        self.attempts = Attempts(plan, self.log)
        self.steps = StepLog(self.log)
        self.chaos = ChaosLog(list(fail_at_steps or []), self.log)
        self.requests = Requests(self.log)
        self.samples = SampleAudit(self.log)
        self.watch = RunWatch(watch or WatchConfig(HangPolicy()))
        self.failures: list[Failure] = []
        self.storage: dict[str, StorageCounters] = {}  # by process
        self.fatal: str | None = None
        self.finished: float | None = None
        self.trained_all = False  # the last step is done: nothing left for chaos to interrupt
        self.drains: DrainRelay | None = None  # in this process for the whole run
        self.decode: DecodeChoice | None = None  # where the run's batches decode, once chosen

    def log(self, line: str) -> None:
        """A progress line for the driver to print."""
        self.lines.append(line)

    # -- attempts ---------------------------------------------------------------------------

    def begin_attempt(self, now: float, world: int | None = None) -> int:
        self.requests.served()  # this is the resized group, if a resize was asked
        return self.attempts.begin(now, world)

    def start_attempt(self, now: float, world: int | None = None) -> AttemptStart:
        """Rank 0, first thing: the attempt's index, and why it must not train (the job was
        already stopped by a fatal error -- a data error raised on one rank restarts the group
        once -- or a restart loop: the last attempts all failed without progress)."""
        index = self.begin_attempt(now, world)
        c = self.watch.config
        stop = self.fatal or restart_loop(
            self.attempts.records, c.restart_loop_attempts, c.restart_loop_min_steps
        )
        if stop:
            self.set_fatal(stop)
        return AttemptStart(attempt=index, stop=stop)

    def register_worker(self, attempt: int, rank: int, place: WorkerPlace) -> None:
        self.attempts.register(attempt, rank, place)
        self.watch.register(attempt, rank, place, place.time or time.time())

    def restored(self, attempt: int, restore: Restore) -> None:
        self.attempts.restored(attempt, restore)

    def step_done(self, attempt: int, step: int) -> None:
        """Rank 0 after every step: the exact high-water mark, for lost-work accounting."""
        self.attempts.reached(attempt, step)
        total = self.plan.steps_per_epoch * self.plan.epochs
        if total and step >= total:
            self.trained_all = True

    def first_step(self, attempt: int, first: FirstStep) -> None:
        """The attempt's first trained step: when it ended, what it took (its batch wait and
        the step itself, which goodput counts as data wait and training, not set-up), and rank
        0's set-up phases before it."""
        self.attempts.first_step(attempt, first)

    def progress_update(self, attempt: int, progress: Progress, metrics: dict[str, float]) -> None:
        self.steps.progress_update(attempt, progress, metrics, self.attempts[attempt].world_size)
        self.attempts.reached(attempt, progress.step)

    # -- the watch --------------------------------------------------------------------------

    def heartbeat(self, attempt: int, rank: int, beat: Beat) -> float:
        """A rank's progress (about once a second); the answer is the share of each step it
        sleeps (chaos=slow)."""
        return self.watch.beat(attempt, rank, beat, time.time())

    def check_watch(self, now: float) -> list[Hang | Straggler]:
        """The driver, every poll: a hang or a straggler to act on (see ftjob.policy.hang)."""
        latest = self.attempts.latest
        quiet = self.finished or self.fatal or self.requests.stop
        if latest is None or latest.planned_end or quiet:
            return []
        if self.failures and self.failures[-1].attempt == latest.index:
            return []  # Ray Train is restarting the group: its workers are gone, not hung
        actions, lines = self.watch.check(now)
        self.lines.extend(lines)
        return actions

    def hang_handled(self, time_of_hang: float, result: StackCapture) -> None:
        self.log(self.watch.handled(time_of_hang, result))

    # -- events -----------------------------------------------------------------------------

    def validation(self, attempt: int, step: int, result: ValidationResult) -> None:
        self.steps.validation(attempt, step, result)

    def checkpoint(self, attempt: int, record: CheckpointRecord) -> None:
        self.steps.checkpoint(attempt, record)

    def storage_stats(self, source: str, stats: StorageCounters) -> None:
        """Cumulative storage counters of one process (a worker of an attempt, the controller)."""
        self.storage[source] = stats

    def failure_noticed(self, now: float, errors: dict[int, str]) -> None:
        latest = self.attempts.latest
        attempt = latest.index if latest is not None else None
        self.failures.append(Failure(noticed=now, errors=errors, attempt=attempt))
        first = next(iter(errors.values()), "")
        self.log(f"failure noticed ({len(errors)} worker(s)): {shorten(first, 200)}")

    def set_fatal(self, error: str) -> None:
        if self.fatal is None:
            self.fatal = error
            self.log(f"fatal: {error}")

    def audit_step(
        self, attempt: int, step: int, epoch: int, ids: list[int], skipped: list[int]
    ) -> None:
        self.samples.step(attempt, step, epoch, ids, skipped)

    def skipped_files(self, attempt: int, rank: int, files: list[SkippedFile]) -> dict[str, int]:
        return self.samples.skipped_files(attempt, rank, files)

    def decode_choice(self, proposed: DecodeChoice | None) -> DecodeChoice | None:
        """The run's decode place: the first one proposed (auto's probe, a restored
        checkpoint's) is kept, so a restarted attempt decodes as the first did."""
        if self.decode is None and proposed is not None:
            self.decode = proposed
        return self.decode

    def finish(self, now: float) -> None:
        self.finished = now

    # -- chaos ------------------------------------------------------------------------------

    def chaos_view(self) -> ChaosView:
        return chaos_view(self.attempts.records, self.trained_all or self.finished is not None)

    def claim_injected_failure(self, step: int, now: float) -> bool:
        return self.chaos.claim_injected_failure(step, now)

    def kill(self, record: Kill) -> None:
        """A chaos event the killer carried out. A node kill counts once confirmed (the node
        is gone: :meth:`confirm_kill`); until then it is pending, though a simulated cluster
        already replaces the node. ``slow`` makes a rank sleep in every step (its heartbeat
        learns it)."""
        if record.kind == "slow" and record.target.rank is not None:
            fraction = record.slowdown or 0.0
            self.watch.slow = SlowRank(record.attempt or 0, record.target.rank, fraction)
        self.chaos.kill(record)

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        self.chaos.confirm(time_of_kill, confirmed)

    def chaos_skipped(self, record: ChaosSkip) -> None:
        """A kill window that ended without a kill, and why."""
        self.chaos.skip(record)

    def snapshot_kills(self) -> list[Kill]:
        return self.chaos.all_kills()

    def steps_trained(self) -> tuple[int, ...]:
        """Each attempt's steps trained since its restore, by attempt index (a simulated
        cluster's node comes back after ``ray.replace_after_steps`` of them)."""
        return tuple(
            a.max_step - (a.restored.step if a.restored else 0) for a in self.attempts.records
        )

    # -- notices: preemption and planned resizes ----------------------------------------------

    def request_stop(self, reason: str, now: float) -> None:
        """The driver got a notice (SIGTERM): the workers checkpoint their current step.
        Workers already checkpointing for a resize need do nothing else: that checkpoint is
        the notice's."""
        self.attempts.resize_became_stop(self.requests.executed)
        self.requests.request_stop(reason, now)

    def stop_requested(self) -> bool:
        return self.requests.stop is not None

    def request_resize(self, current: int, target: int, now: float) -> None:
        self.requests.request_resize(current, target, now)

    def notice_request(self) -> NoticeSource | None:
        return self.requests.notice()

    def resize_executed(self, now: float) -> None:
        """The scaling policy handed Ray Train a resize of the running group."""
        self.requests.executed_now(now)

    def resize_checkpointed(self) -> bool:
        """The latest attempt committed (or tried to) its checkpoint for the resize asked now
        (not for an earlier one, whose record the previous group's attempt still holds)."""
        state = self.requests.resize_state(self.attempts.latest)
        return state == ResizeState.checkpointed

    def preemption_notice(self, attempt: int, notice: Notice) -> None:
        """Rank 0, when every rank agreed on a notice (before the just-in-time checkpoint).
        A stop that came meanwhile makes a resize's notice the stop's."""
        if notice.source == NoticeSource.resize and self.requests.stop is not None:
            notice = dataclasses.replace(notice, source=NoticeSource.driver)
        self.attempts.notice(attempt, notice, self.requests.resize)

    def jit_checkpoint(self, attempt: int, record: JitCheckpoint) -> None:
        self.attempts.jit_checkpoint(attempt, record)

    def latest_preemption(self) -> Notice | None:
        """The latest attempt's notice and JIT checkpoint record (for the driver's wait)."""
        latest = self.attempts.latest
        return latest.preemption if latest is not None else None

    def watch_drains(
        self, interval: float, nodes: dict[str, list[int]], actors: dict[int, Any]
    ) -> None:
        """Ray Train, per worker group: which ranks run on which node ({} after shutdown)."""
        if self.drains is None:
            self.drains = DrainRelay(interval)
        self.drains.watch(nodes, actors)
        self.drains.start()

    # -- reading ----------------------------------------------------------------------------

    def log_feed(self, cursor: int) -> LogFeed:
        return self.steps.feed(cursor, self.finished is not None)

    def poll(self, cursor: int) -> tuple[list[str], int]:
        return self.lines[cursor:], len(self.lines)

    def pull(self, cursor: int) -> RecordPull:
        """What the driver keeps of the run on its side (about every few seconds): the
        snapshot without its audit, and the audit's slices since ``cursor``."""
        audit, after = self.samples.since(cursor)
        return RecordPull(self.snapshot(audit=False), audit, after)

    def snapshot(self, audit: bool = True) -> RunSnapshot:
        return RunSnapshot(
            plan=self.plan,
            started=self.started,
            finished=self.finished,
            attempts=tuple(self.attempts.records),
            failures=tuple(self.failures),
            kills=tuple(self.chaos.kills),
            chaos_skipped=tuple(self.chaos.skipped_at_end()),
            injected=tuple(self.chaos.injected),
            validations=self.steps.validations_in_order(),
            replaced_validations=self.steps.replaced_validations,
            checkpoints=tuple(self.steps.checkpoints),
            storage=dict(self.storage),
            audit=self.samples.audited() if audit else (),
            skipped_files=self.samples.files(),
            decode=self.decode,
            metrics=dict(self.steps.metrics),
            progress=self.steps.progress,
            history=self.steps.history_in_order(),
            fatal=self.fatal,
            stop_request=self.requests.stop,
            executed_resizes=tuple(self.requests.executed),
            watch=self.watch.snapshot(),
        )


def _conforms(ledger: RunLedger) -> WorkerLedger:
    """The ledger implements what a training worker calls (checked by the type checker)."""
    return ledger


class _FailureWatch:
    """Ray Train controller callback: tells the ledger when a worker failure is noticed."""

    def __init__(self, ledger: Actor[RunLedger]) -> None:
        self.ledger = ledger

    def _send_storage_stats(self, run_context: Any) -> None:
        # The controller's own storage requests (run state, Ray's checkpoint bookkeeping).
        handler = getattr(run_context.run_config.storage_filesystem, "handler", None)
        fs: Any = getattr(handler, "fs", None)
        if hasattr(fs, "snapshot_stats"):
            tell(self.ledger, RunLedger.storage_stats, "controller", fs.snapshot_stats().as_dict())

    def after_report(self, run_context: Any, metrics: Any, checkpoint: Any) -> None:
        self._send_storage_stats(run_context)

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        self._send_storage_stats(run_context)
        errors = {int(rank): one_line(e) for rank, e in worker_exceptions.items()}
        tell(self.ledger, RunLedger.failure_noticed, time.time(), errors)


def one_line(error: BaseException) -> str:
    """An exception as its type and its message's last line (a traceback's error)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {shorten(text.splitlines()[-1], 300) if text else ''}"


def failure_watch(ledger: Actor[RunLedger]) -> Any:
    from ray.train import UserCallback

    cls = type("FailureWatch", (_FailureWatch, UserCallback), {})
    return cls(ledger)


def start_ledger(plan: RunPlan, fail_at_steps: list[int], watch: WatchConfig) -> Actor[RunLedger]:
    """Start the ledger actor on this (the driver's) node; it never moves off it."""
    from ftjob.placement import start_pinned_actor

    return start_pinned_actor(RunLedger, plan, fail_at_steps, watch)


def empty_snapshot(fatal: str | None = None) -> RunSnapshot:
    """The record of a run that never reached the cluster (or whose ledger was lost)."""
    watch = RunWatch(WatchConfig(HangPolicy())).snapshot()  # the defaults' timeouts
    return RunSnapshot(started=time.time(), fatal=fatal, watch=watch)
