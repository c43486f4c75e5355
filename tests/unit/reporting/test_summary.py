"""summary.json figures from a ledger, built by hand (no Ray)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ftjob import metrics as M
from ftjob.driver.ledger import RunLedger
from ftjob.policy.hang import SECTIONS
from ftjob.record import (
    Attempt,
    AuditStep,
    ChaosSkip,
    CheckpointRecord,
    DecodeChoice,
    Failure,
    Fallback,
    FirstStep,
    Hang,
    HistoryPoint,
    Injected,
    JitCheckpoint,
    Kill,
    KillTarget,
    Notice,
    NoticeSource,
    Progress,
    Restore,
    RunPlan,
    RunSnapshot,
    RunStatus,
    SectionTimeout,
    SkippedFile,
    StackCapture,
    Straggler,
    StragglerReport,
    StragglerScore,
    Tier,
    ValidationResult,
    WatchRecord,
    WorkerPlace,
)
from ftjob.reporting.audit import audit_batches, audit_report
from ftjob.reporting.failures import failure_records
from ftjob.reporting.run_summary import AlreadyFinished, EpochAudit, RunSummary
from ftjob.reporting.schema import check_summary, summary_schema
from ftjob.reporting.summary import build_summary, format_summary, read_summary, write_summary
from ftjob.reporting.verdict import FitEnd, RunEnd, decide_status
from tests.support.ledgers import PLAN, make_ledger, restored, train


def test_failure_records_measure_each_part_of_recovery():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(100.0)
    ledger.first_step(a0, FirstStep(1, 110.0))
    train(ledger, a0, range(1, 5))
    ledger.kill(Kill(120.0, "node", KillTarget("n1", ranks=(0,)), a0))
    ledger.failure_noticed(125.0, {0: "ActorDiedError: node died"})
    ledger.confirm_kill(120.0, True)  # Ray marks the node dead after the failure is noticed
    a1 = ledger.begin_attempt(130.0)
    ledger.restored(a1, restored(2))
    parts = {"process_group": 0.4, "model": 1.2, "first_batch": 0.1, "first_step": 0.3}
    ledger.first_step(a1, FirstStep(3, 134.0, 0.4, parts))
    train(ledger, a1, range(3, 6))
    ledger.finish(140.0)
    [f] = failure_records(ledger.snapshot())
    r = f.recovery
    assert r is not None and r.phases == parts and r.first_step_s == 0.4
    assert f.kind == "node_kill" and f.recovered
    assert f.detection_s == pytest.approx(5.0)
    assert r.restart_s == pytest.approx(5.0)
    assert f.time_to_recover_s == pytest.approx(14.0)
    assert r.restoration_s == pytest.approx(0.76)
    assert f.lost_steps == 2  # trained to step 4, restored step 2


def continued(ledger: RunLedger, started: float, step: int, first: FirstStep, until: int) -> int:
    """An attempt that restored ``step`` at ``started``, its first step ``first``, trained up
    to ``until`` (exclusive); its index."""
    a = ledger.begin_attempt(started)
    ledger.restored(a, restored(step))
    ledger.first_step(a, first)
    train(ledger, a, range(step + 1, until))
    return a


def test_a_preempted_attempt_with_no_failure_noticed_leaves_the_next_failures_their_own():
    # A drained node's workers end at its deadline and Ray Train restarts the group without
    # noticing a failure; the worker kill after it is still the failure of its own attempt
    # (where pairing failures with attempts by their order gave the kill a time to recover
    # measured from the next failure's origin: negative, its detail another kill's).
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(a0, FirstStep(1, 12.0))
    train(ledger, a0, range(1, 3))
    preempt = Kill(14.0, "preempt", KillTarget("n1", ranks=(0,)), a0, notice=14.0, deadline=19.0)
    ledger.kill(preempt)
    ledger.confirm_kill(14.0, True)
    ledger.preemption_notice(a0, Notice(NoticeSource.drain, 14.5, 2, deadline=19.0, ranks=(0,)))
    a1 = continued(ledger, 22.0, 2, FirstStep(3, 25.0), 4)
    ledger.kill(Kill(30.0, "worker", KillTarget("n2", rank=0, pid=7), a1))
    ledger.failure_noticed(31.0, {0: "ActorDiedError: worker died"})
    a2 = continued(ledger, 35.0, 3, FirstStep(4, 38.0), 5)
    ledger.kill(Kill(40.0, "node", KillTarget("n3", ranks=(0,)), a2))
    ledger.confirm_kill(40.0, True)
    ledger.failure_noticed(41.5, {0: "ActorDiedError: node died"})
    continued(ledger, 45.0, 4, FirstStep(5, 47.0), 6)
    ledger.finish(50.0)
    preempted, killed, lost = failure_records(ledger.snapshot())
    assert [f.attempt for f in (preempted, killed, lost)] == [1, 2, 3]
    assert preempted.kind == "preemption" and preempted.time == 19.0
    assert preempted.detection_s == 0.0 and preempted.time_to_recover_s == pytest.approx(6.0)
    assert killed.kind == "worker_kill" and killed.error == "ActorDiedError: worker died"
    assert killed.detection_s == pytest.approx(1.0) and killed.time_to_recover_s == pytest.approx(
        8.0
    )
    assert lost.kind == "node_kill" and lost.time_to_recover_s == pytest.approx(7.0)
    assert all(f.recovered for f in (preempted, killed, lost))


def test_a_restart_that_died_starting_is_its_own_failure_inside_the_recovery_before_it():
    # A worker kill; Ray Train's restarted group dies before it begins an attempt (a second
    # notice while the same attempt is the latest: the ledger's order, not clocks, pairs a
    # notice with its attempt); the next group recovers.
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(a0, FirstStep(1, 16.0))
    train(ledger, a0, range(1, 3))
    ledger.kill(Kill(12.0, "worker", KillTarget("n1", rank=0, pid=7), a0))
    ledger.failure_noticed(13.0, {0: "ActorDiedError: worker died"})
    ledger.failure_noticed(17.0, {1: "ActorDiedError: died starting"})
    a1 = continued(ledger, 24.0, 2, FirstStep(3, 27.0, 0.5), 4)
    ledger.kill(Kill(26.5, "node", KillTarget("n2", ranks=(0,)), a1))
    ledger.confirm_kill(26.5, True)
    ledger.failure_noticed(27.5, {0: "ActorDiedError: node died"})
    continued(ledger, 33.0, 3, FirstStep(4, 36.0, 0.5), 6)
    ledger.finish(40.0)
    snap = ledger.snapshot()
    killed, restart, node = failure_records(snap)
    assert (killed.attempt, restart.attempt, node.attempt) == (1, 1, 2)
    assert killed.kind == "worker_kill" and killed.detection_s == pytest.approx(1.0)
    assert killed.time_to_recover_s == pytest.approx(15.0)  # 12 -> the first step at 27
    assert restart.kind == "error" and restart.error == "ActorDiedError: died starting"
    assert restart.time == 17.0 and restart.recovery is None and restart.recovered
    assert node.kind == "node_kill" and node.time_to_recover_s == pytest.approx(9.5)
    summary = build_summary(
        snap, name="r", status=RunStatus.succeeded, error=None, wall_time_s=26.0, config={}
    )
    lines = format_summary(summary).splitlines()
    assert "  failure 1: error as the group started again, recovered with it" in lines
    assert sum(line.startswith("  failure ") for line in lines) == 3
    assert all(f.time_to_recover_s is None or f.time_to_recover_s > 0 for f in (killed, node))


def test_budget_exhausted_failure_is_not_recovered():
    ledger = make_ledger()
    ledger.begin_attempt(0.0)
    ledger.claim_injected_failure(3, 5.0)
    ledger.failure_noticed(6.0, {0: "InjectedFailure: step 3"})
    [f] = failure_records(ledger.snapshot())
    assert f.kind == "injected" and not f.recovered and f.detection_s == pytest.approx(1.0)
    assert f.recovery is None and "restart_s" not in f.to_json()  # no attempt came after it
    assert not ledger.claim_injected_failure(3, 7.0)  # each injected failure fires once


def test_summary_has_every_metric_key_json_safe_and_audit_excludes_lost_work(tmp_path):
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 5))  # steps 3-4 are lost: the next attempt restores step 2
    ledger.failure_noticed(5.0, {0: "boom"})
    a1 = ledger.begin_attempt(6.0)
    ledger.restored(a1, restored(2))
    ledger.first_step(a1, FirstStep(3, 7.0))
    train(ledger, a1, range(3, 6))
    ledger.validation(a0, 4, ValidationResult(0, loss=1.0, accuracy=0.5, samples=8, time=5.0))
    ledger.validation(  # replaces, not duplicates
        a1, 4, ValidationResult(0, loss=0.5, accuracy=0.75, samples=8, time=8.0)
    )
    ledger.progress_update(
        a1,
        Progress(5, 0, 1, 5, loss=0.1, throughput=9.0, lr=0.01),
        {M.TRAIN_ROWS_PROCESSED: 40, M.TRAIN_STEP: 2.0, M.TRAIN_ITER_BATCH: float("inf")},
    )
    ledger.checkpoint(a1, CheckpointRecord(5, "/ck/step_5", None, 0.1))
    ledger.finish(9.0)
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=9.0,
        config={},
    )
    assert set(M.METRIC_KEYS) <= set(summary.metrics)
    assert summary.metrics[M.VALIDATION_ACCURACY] == 0.75 and summary.validation_replaced == 1
    assert [v.step for v in summary.validation] == [4]
    assert summary.metrics[M.CHECKPOINT_RESTORATION_TIME] == pytest.approx(0.76)
    assert summary.checkpoints.committed == 1
    assert summary.audit == (EpochAudit(epoch=0, trained=40, unique=40),)
    text = open(write_summary(summary, str(tmp_path))).read()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["status"] == "succeeded"
    assert json.loads(text)["audit"] == [
        {
            "epoch": 0,
            "resumed_at": 0,
            "trained": 40,
            "skipped": 0,
            "unique": 40,
            "duplicates": 0,
            "missing": 0,
            "unexpected": 0,
            "misplaced": 0,
        }
    ]


def test_audit_catches_a_replayed_batch():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6))
    ledger.audit_step(a0, 5, 0, PLAN.shard(0, 0, 0, 1)[:8].tolist(), [])  # batch 0 again
    [a] = (
        build_summary(
            ledger.snapshot(),
            name="r",
            status=RunStatus.failed,
            error="x",
            wall_time_s=1,
            config={},
        ).audit
        or ()
    )
    assert a.duplicates == 8 and a.missing == 0 and not a.exactly_once


def test_a_slice_of_a_step_the_run_ended_inside_is_not_the_models():
    # Slices are sent as their step starts: the run stopped inside step 4 (no step_done).
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 4))
    ledger.audit_step(a0, 4, 0, PLAN.shard(0, 24, 0, 1)[:8].tolist(), [])
    [a] = audit_report(ledger.snapshot())
    assert a.trained == 24 and a.unique == 24 and a.duplicates == 0


# -- the verdict: a pure function of the ledger snapshot and how fit() ended ----------------


def finished_snapshot(fatal: str | None = None, finished: bool = True) -> RunSnapshot:
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6), audit=False)
    ledger.failure_noticed(3.0, {0: "ActorDiedError: killed"})
    if fatal:
        ledger.set_fatal(fatal)
    if finished:
        ledger.finish(9.0)
    return ledger.snapshot()


def test_a_run_that_trained_to_the_end_succeeded():
    assert decide_status(finished_snapshot(), FitEnd(), max_failures=3) == ("succeeded", None)


def test_a_fatal_upload_failure_fails_the_run_with_its_reason():
    fatal = "2 checkpoint upload(s) in a row failed (checkpoint.max_consecutive_upload_failures=1)"
    status, error = decide_status(
        finished_snapshot(fatal=fatal, finished=False), FitEnd(), max_failures=3
    )
    assert (status, error) == ("failed", fatal)


def test_an_exhausted_failure_budget_names_count_and_budget():
    fit = FitEnd(RunEnd.FAILURES_EXHAUSTED, "ActorDiedError: worker killed")
    status, error = decide_status(finished_snapshot(finished=False), fit, max_failures=0)
    assert status == "failed"
    assert error == (
        "training failed after 1 failure(s), over the budget failure.max_failures=0: "
        "ActorDiedError: worker killed"
    )


def test_fit_raising_for_another_reason_fails_with_that_error():
    fit = FitEnd(RunEnd.ERRORED, "ControllerError: storage marker missing")
    assert decide_status(finished_snapshot(), fit, 3) == (
        "failed",
        "ControllerError: storage marker missing",
    )


def test_a_run_that_ended_before_its_last_step_is_not_a_success():
    assert decide_status(finished_snapshot(finished=False), FitEnd(), 3) == (
        "failed",
        "training ended before the last epoch",
    )


def test_an_interrupted_run_says_so_whatever_else_happened():
    status, error = decide_status(finished_snapshot(), FitEnd(RunEnd.INTERRUPTED), 3)
    assert status == "interrupted" and "Ctrl-C" in error


def test_ray_dying_under_a_run_fails_it_with_why_unless_the_record_failed_it_first():
    died = FitEnd(RunEnd.RAY_DIED, "Ray died under the run: the embedded Ray's raylet ended")
    assert decide_status(finished_snapshot(finished=False), died, 3) == (
        RunStatus.failed,
        died.error,
    )
    earlier = decide_status(finished_snapshot(fatal="a data error", finished=False), died, 3)
    assert earlier == (RunStatus.failed, "a data error")


def test_a_finished_run_whose_audit_shows_a_replayed_batch_failed():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6))
    ledger.audit_step(a0, 5, 0, PLAN.shard(0, 0, 0, 1)[:8].tolist(), [])  # batch 0 again
    ledger.finish(9.0)
    status, error = decide_status(ledger.snapshot(), FitEnd(), 3)
    assert status == "failed"
    assert error.startswith("exact-once broken: epoch 0 trained 8 duplicate, 0 missing")


def test_steps_that_trained_each_other_s_batch_fail_the_run_though_every_sample_came_once():
    """At any world size step k trains the data order's k-th global batch; two steps that
    swapped batches keep the epoch's sample set but are not the same training."""
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 4))
    for step, batch in ((4, 5), (5, 4)):
        ledger.audit_step(a0, step, 0, PLAN.shard(0, (batch - 1) * 8, 0, 1)[:8].tolist(), [])
        ledger.step_done(a0, step)
    ledger.finish(9.0)
    snap = ledger.snapshot()
    [epoch] = audit_report(snap)
    assert (epoch.duplicates, epoch.missing, epoch.misplaced) == (0, 0, 2)
    status, error = decide_status(snap, FitEnd(), 3)
    assert status == "failed" and "2 step(s) not on their global batch" in error
    steps = [step for step, _ in audit_batches(snap)]
    assert steps == [1, 2, 3, 4, 5]


def test_a_resumed_run_expects_only_the_samples_after_its_resume_position():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.restored(a0, restored(2))  # an earlier run trained steps 1-2 (samples 0-15)
    ledger.first_step(a0, FirstStep(3, 1.0))
    train(ledger, a0, range(3, 6))
    ledger.finish(9.0)
    snap = ledger.snapshot()
    summary = build_summary(
        snap, name="r", status=RunStatus.failed, error=None, wall_time_s=1, config={}
    )
    [a] = summary.audit or ()
    assert (a.resumed_at, a.unique, a.missing, a.duplicates) == (16, 24, 0, 0)
    assert decide_status(snap, FitEnd(), 3) == ("succeeded", None)


def test_non_finite_values_are_null_in_the_summary_and_its_printout(tmp_path):
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6), audit=False)
    progress = Progress(5, 0, 1, 5, loss=float("nan"), throughput=9.0, lr=0.01)
    ledger.progress_update(a0, progress, {M.TRAIN_LOSS: float("nan")})
    ledger.validation(a0, 5, ValidationResult(0, float("inf"), accuracy=0.1, samples=8, time=1.0))
    summary = build_summary(
        ledger.snapshot(), name="r", status=RunStatus.failed, error="x", wall_time_s=1, config={}
    )
    document = summary.document()
    assert document["metrics"][M.TRAIN_LOSS] is None
    assert document["metrics"][M.VALIDATION_LOSS] is None
    assert document["progress"]["loss"] is None and document["validation"][0]["loss"] is None
    written = read_summary(write_summary(summary, str(tmp_path)))
    assert written.metrics[M.TRAIN_LOSS] is None and written.progress.loss is None
    assert "loss null" in "\n".join(ledger.lines) and "train loss null" in format_summary(summary)
    assert "train loss null" in format_summary(written)


def test_chaos_that_did_not_happen_is_in_the_summary_with_its_reason():
    ledger = make_ledger()
    ledger.begin_attempt(0.0)
    ledger.kill(Kill(5.0, "node", KillTarget("n1", ranks=(0,)), 0))
    ledger.kill(Kill(9.0, "node", KillTarget("n2", ranks=(1,)), 0))
    ledger.confirm_kill(5.0, False)
    ledger.chaos_skipped(ChaosSkip(7.0, "node", "no eligible target", 0, window=2))
    summary = build_summary(
        ledger.snapshot(), name="r", status=RunStatus.failed, error=None, wall_time_s=1, config={}
    )
    assert summary.chaos.kills == () and summary.metrics[M.CHAOS_KILLS] == 0
    reasons = [s.reason for s in summary.chaos.skipped]
    assert reasons == [
        "the node was not confirmed dead",
        "no eligible target",
        "not confirmed dead before the run ended",
    ]
    assert any("chaos: no node kill: no eligible target" in line for line in ledger.lines)
    assert "  chaos: no node kill: no eligible target" in format_summary(summary).splitlines()


# -- summary.json's shape: every key it has always had, no more ------------------------------

CHAOS_CONFIG = {"chaos": {"kind": "worker", "interval": 10.0, "max_kills": 3, "at_steps": []}}


def _batch(step: int) -> tuple[int, ...]:
    return tuple(PLAN.shard((step - 1) // 5, ((step - 1) % 5) * 8, 0, 1)[:8].tolist())


PLACES = {0: WorkerPlace("head", 100, 1, 10.5), 1: WorkerPlace("n1", 101, 2, 10.6)}
PHASES = {"process_group": 0.4, "model": 1.2, "first_batch": 0.1, "first_step": 0.3}


def _attempt(index: int, started: float, world: int, restore: Restore | None, **rest) -> Attempt:
    places = PLACES if world == 2 else {0: PLACES[0]}
    return Attempt(index, started, world, places, restore, **rest)


def rich_attempts() -> tuple[Attempt, ...]:
    """An injected failure; a restore that fell back past two checkpoints, then a worker kill;
    a restore from the memory tier, then a hang; a preemption with its just-in-time checkpoint
    on one worker (a shrink); a planned grow to two; a straggler restarted; the last attempt."""
    fallbacks = (
        Fallback(4, "/ck/step_4", "checksum mismatch", True, quarantined_to="/ck/.bad/step_4"),
        Fallback(3, "/ck/step_3", "no manifest", False, left="an upload may still write it"),
    )
    jit = JitCheckpoint(8, path="/ck/step_8", reused=False, seconds=0.4, time=55.5)
    preemption = Notice(NoticeSource.drain, 55.0, 8, deadline=65.0, ranks=(0,), jit=jit)
    reused = JitCheckpoint(10, path="/ck/step_10", reused=True, time=75.2)
    resize = Notice(NoticeSource.resize, 75.0, 10, from_=1, to=2, requested=74.5, jit=reused)
    return (
        _attempt(0, 10.0, 2, None, first_step=FirstStep(1, 13.0, 1.0, PHASES), max_step=4),
        _attempt(
            1,
            25.0,
            2,
            Restore(2, 0, 16, "/ck/step_2", 0.5, 0.25, 0.01, fallbacks),
            first_step=FirstStep(3, 28.0, 0.5, PHASES),
            max_step=6,
        ),
        _attempt(
            2,
            34.0,
            2,
            Restore(5, 0, 40, None, 0.0, 0.1, 0.01, tier=Tier.memory),
            first_step=FirstStep(6, 37.0, 0.5),
            max_step=7,
        ),
        _attempt(
            3,
            48.0,
            1,
            Restore(6, 1, 8, "/ck/step_6", 0.5, 0.25, 0.01),
            preemption=preemption,
            first_step=FirstStep(7, 52.0, 0.5),
            max_step=8,
        ),
        _attempt(
            4,
            68.0,
            1,
            Restore(8, 1, 24, "/ck/step_8", 0.5, 0.25, 0.01),
            resize=resize,
            first_step=FirstStep(9, 71.0, 0.5),
            max_step=10,
        ),
        _attempt(
            5,
            78.0,
            2,
            Restore(10, 1, 40, "/ck/step_10", 0.5, 0.25, 0.01),
            first_step=FirstStep(11, 82.0, 0.5),
            max_step=12,
        ),
        _attempt(
            6,
            93.0,
            2,
            Restore(10, 1, 40, "/ck/step_10", 0.5, 0.25, 0.01),
            first_step=FirstStep(11, 96.0, 0.5),
            max_step=15,
        ),
    )


def rich_chaos() -> tuple[tuple[Kill, ...], tuple[ChaosSkip, ...]]:
    """Kills of four kinds; a window without a target, and a node Ray never confirmed dead."""
    worker = KillTarget("n1", pid=101, rank=1)
    kills = (
        Kill(30.0, "worker", worker, 1, killed_pid=101, confirmed=True),
        Kill(38.0, "hang", KillTarget("head", pid=100, rank=0), 2, killed_pid=100, confirmed=True),
        Kill(
            55.0,
            "preempt",
            KillTarget("head", ranks=(0,)),
            3,
            notice=55.0,
            deadline=65.0,
            killed_pid=1,
            confirmed=True,
        ),
        Kill(85.0, "slow", worker, 5, slowdown=0.5, killed_pid=-1, confirmed=True),
    )
    unconfirmed = Kill(86.0, "node", KillTarget("n1", ranks=(1,)), 5, killed_pid=2, confirmed=False)
    preempt = Kill(87.0, "preempt", KillTarget("n1", ranks=(1,)), 5, notice=87.0, deadline=97.0)
    skipped = (
        ChaosSkip(29.0, "worker", "no eligible target", 1, window=2),
        ChaosSkip.of_kill(unconfirmed, "the node was not confirmed dead"),
        ChaosSkip.of_kill(preempt, "the node was not confirmed dead"),
        ChaosSkip(88.0, "slow", "the attempt ended first", 5, target=worker, slowdown=0.5),
    )
    return kills, skipped


def rich_watch() -> WatchRecord:
    """A hang ended by ftjob (its stack captured), a straggler restarted, the sections'
    timeouts, an attempt's start-up phases."""
    hang = Hang(
        44.0, 2, 0, "head", 100, "step", 7, 39.0, 5.0, 4.0, 1.0, True, True, {1: "data"}
    ).handled(
        StackCapture(100, "Thread 100 (idle)", "py-spy", killed=True, error="thread 2: unreadable")
    )
    scores = {"0": StragglerScore(1.0, 1.0), "1": StragglerScore(2.1, 2.0)}
    straggler = Straggler(90.0, 5, 1, "n1", 2.1, 2.0, restarted=True, pid=101)
    return WatchRecord(
        hangs=(hang,),
        stragglers=StragglerReport((straggler,), scores, max_slowdown=2.1, threshold=1.5),
        sections={s: SectionTimeout(3, 0.2, 4.0, True) for s in SECTIONS},
        phases={"1": {"setup": 1.0, "restore": 0.8, "warmup": 0.5}},
    )


def rich_snapshot() -> RunSnapshot:
    """A run that met everything summary.json records: the attempts, chaos and watch above,
    validations (one replaced), checkpoints (one failed), storage counters of two processes,
    the sample audit (a step with a skipped sample) and a skipped bad file."""
    kills, skipped = rich_chaos()
    counters = {"calls": 4.0, "attempts": 5.0, "retries": 1.0, "failures": 0.0}
    return RunSnapshot(
        plan=RunPlan(40, 8, 40, 5, 0, 3, 2),
        started=8.0,
        finished=106.0,
        attempts=rich_attempts(),
        failures=(
            Failure(21.0, {0: "InjectedFailure: step 4"}),
            Failure(31.0, {1: "ActorDiedError: worker died"}),
            Failure(45.0, {0: "ActorDiedError: hung worker killed"}),
            Failure(65.5, {0: "ActorDiedError: node preempted"}),
            Failure(91.0, {1: "ActorDiedError: straggler restarted"}),
        ),
        kills=kills,
        chaos_skipped=skipped,
        injected=(Injected(20.0, 4),),
        validations=(
            ValidationResult(0, 1.0, 0.5, 10, 15.0, step=2, attempt=0),
            ValidationResult(1, 0.5, 0.75, 10, 74.0, step=10, attempt=4),
        ),
        replaced_validations=1,
        checkpoints=(
            CheckpointRecord(2, "/ck/step_2", None, 1.0, 15.0, attempt=0),
            CheckpointRecord(4, None, "OSError: upload failed", 2.0, 19.0, attempt=0),
            CheckpointRecord(8, "/ck/step_8", None, 0.4, 55.5, attempt=3),
            CheckpointRecord(10, "/ck/step_10", None, 0.5, 74.0, attempt=4),
            CheckpointRecord(15, "/ck/step_15", None, 0.5, 105.5, attempt=6),
        ),
        storage={
            "attempt 0 rank 0": {"upload": counters, "list": counters, "download": counters},
            "controller": {"other": counters, "delete": counters},
        },
        audit=(
            AuditStep(0, 1, 0, _batch(1)),
            AuditStep(0, 2, 0, _batch(2), skipped=(_batch(2)[0],)),
            AuditStep(6, 15, 2, _batch(15)),
        ),
        skipped_files=(SkippedFile("train", 7, "/data/train/7.png", "truncated", 0, 0),),
        decode=DecodeChoice("device", "auto's probe", {"device": 5400.0, "worker": 900.0}),
        metrics={
            M.TRAIN_STEP: 20.0,
            M.TRAIN_ITER_BATCH: 4.0,
            M.TRAIN_STEPS_COMPLETED: 15,
            M.TRAIN_ROWS_PROCESSED: 120,
            M.CHECKPOINT_UPLOAD: 3.0,
        },
        progress=Progress(15, 2, 3, 15, 0.2, 90.0, 0.01, 105.0, attempt=6),
        history=(
            HistoryPoint(5, 40.0, 2, 0.8, 80.0, 0.01, 2),
            HistoryPoint(15, 105.0, 6, 0.2, 90.0, 0.01, 2),
        ),
        executed_resizes=(76.0,),
        watch=rich_watch(),
    )


def rich_summary() -> RunSummary:
    """The summary of :func:`rich_snapshot`, with what the driver adds to a run that did not
    succeed (the checkpoint committed as it stopped, the command that continues it) and to a
    rerun that found its run finished."""
    summary = build_summary(
        rich_snapshot(),
        name="rich",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=110.0,
        config=CHAOS_CONFIG,
        run_started=5.0,
    )
    return dataclasses.replace(
        summary,
        checkpoints=dataclasses.replace(summary.checkpoints, committed_while_stopping=16),
        resume_command="python -m ftjob name=rich resume=true",
        already_finished=AlreadyFinished(15, "/ck/step_15"),
    )


def test_summary_json_holds_what_its_types_say_and_reads_back_unchanged(tmp_path):
    """summary.json of a run that met everything it records holds every key its schema --
    generated from RunSummary's types -- has, and nothing else: a renamed, dropped or added
    key, in a record the summary embeds too, fails here, not in a reader of summary.json. The
    file reads back as the same summary."""
    summary = rich_summary()
    kinds = [(f.kind, f.recovered) for f in summary.failures]
    assert kinds == [
        ("injected", True),
        ("worker_kill", True),
        ("hang", True),
        ("preemption", True),
        ("straggler", True),
    ]
    assert [(r.kind, r.cause) for r in summary.resizes] == [
        ("shrink", "failure"),
        ("grow", "planned"),
    ]
    written = json.loads(open(write_summary(summary, str(tmp_path))).read())
    found, problems = check_summary(written)
    assert not problems, problems
    schema = summary_schema()
    assert not set(schema) - found - UNMADE, sorted(set(schema) - found - UNMADE)
    assert UNMADE <= set(schema)
    assert read_summary(str(tmp_path / "summary.json")) == RunSummary.from_json(written)
    assert RunSummary.from_json(written).document() == written


# What the types allow and no run makes: a failure's notice is written without its
# just-in-time checkpoint (the failure has it), and a preemption's notice has no resize.
UNMADE = {
    ".failures[].notice.jit",
    *(
        f".failures[].notice.jit.{k}"
        for k in ("step", "path", "reason", "reused", "seconds", "time")
    ),
    *(f".failures[].notice.{k}" for k in ("from", "to", "requested")),
}


def test_every_key_a_summary_has_always_is_in_one_of_a_job_that_never_started(tmp_path):
    """A job that never reached the cluster writes the keys its schema says are always there
    (metrics, all of them, included), and readers get every figure as 0."""
    summary = build_summary(
        RunSnapshot(), name="", status=RunStatus.failed, error="x", wall_time_s=0.0, config={}
    )
    written = json.loads(open(write_summary(summary, str(tmp_path))).read())
    found, problems = check_summary(written)
    assert not problems, problems
    always = {path for path, there in summary_schema().items() if there}
    assert always <= found, sorted(always - found)
    assert set(written["metrics"]) == set(M.METRIC_KEYS)
    assert "steps 0 (0.0 s in them: train/step), 0 img/s" in format_summary(
        RunSummary.from_json(written)
    )


def test_a_document_the_types_refuse_is_named_key_by_key():
    document = rich_summary().document()
    document["failures"][0]["restart_seconds"] = 1.0  # renamed
    del document["checkpoints"]["latest"]  # dropped
    document["metrics"]["train/new_metric"] = 0.0  # a metric key not in metrics.py
    document["status"] = "fine"
    _, problems = check_summary(document)
    assert sorted(problems) == [
        ".checkpoints.latest: missing",
        ".failures[].restart_seconds: no such key in FailureRecord",
        ".metrics.train/new_metric: no such key",
        ".status: 'fine' is no RunStatus",
    ]


def test_an_attempt_that_stopped_at_its_start_neither_drops_nor_loses_the_steps_before_it():
    """A driver that lost its run: its last attempt found the run held by another driver at its
    start -- no restore, no step. The steps before it stand (the next driver restores them from
    the just-in-time checkpoint or a snapshot): they are neither thrown out of the audit nor
    counted as lost; and an attempt that died in its set-up before restoring does not cut off
    the steps an attempt after it restored."""
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 4))
    ledger.failure_noticed(4.0, {0: "PreemptionError: drained"})
    ledger.begin_attempt(5.0)  # stopped at its start: the run is another driver's now
    ledger.finish(9.0)
    snap = ledger.snapshot()
    assert [step for step, _ in audit_batches(snap)] == [1, 2, 3]
    [failure] = failure_records(snap)
    assert failure.lost_steps == 0 and not failure.recovered

    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 5))
    ledger.failure_noticed(4.0, {0: "ActorDiedError: killed"})
    ledger.begin_attempt(5.0)  # killed in its set-up, before it restored anything
    ledger.failure_noticed(6.0, {0: "ActorDiedError: killed again"})
    a2 = ledger.begin_attempt(7.0)
    ledger.restored(a2, restored(3))
    ledger.first_step(a2, FirstStep(4, 1.0))
    train(ledger, a2, range(4, 6))
    ledger.finish(9.0)
    steps = [step for step, _ in audit_batches(ledger.snapshot())]
    assert steps == [1, 2, 3, 4, 5]
