"""Goodput: every second of a run's wall clock in one bucket (no Ray: a ledger by hand); the
first-order model of ETTR against the checkpoint interval, and the auto interval."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ftjob import metrics as M
from ftjob.config import ConfigError, FailureConfig, JobConfig, TrainerConfig
from ftjob.policy.cadence import CheckpointSchedule
from ftjob.record import (
    CheckpointRecord,
    FirstStep,
    JitCheckpoint,
    Kill,
    KillTarget,
    Notice,
    NoticeSource,
    Progress,
    RunStatus,
)
from ftjob.reporting.goodput import BUCKETS, goodput, predict_ettr
from ftjob.reporting.run_summary import (
    Buckets,
    FailureRecord,
    Goodput,
    PreemptionPart,
    Recovery,
    RunSummary,
)
from ftjob.reporting.summary import build_summary, declared_failures
from tests.support.ledgers import make_ledger, restored, train


def test_buckets_sum_to_the_wall_clock_and_name_each_cause():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(
        a0, FirstStep(1, 13.0, 1.0)
    )  # its first batch and step: data_wait and training
    train(ledger, a0, range(1, 5), audit=False)  # steps 3-4 are lost with the failure
    ledger.kill(Kill(20.0, "worker", KillTarget("n1", pid=1, rank=0), a0))
    ledger.failure_noticed(21.0, {0: "ActorDiedError"})
    a1 = ledger.begin_attempt(25.0)
    ledger.restored(a1, restored(2))  # download 0.5, load 0.25, skip 0.01
    ledger.first_step(
        a1, FirstStep(3, 28.0, 0.5)
    )  # its batch wait and step: data_wait and training
    train(ledger, a1, range(3, 6), audit=False)
    timers = {
        M.TRAIN_STEP: 5.0,
        M.TRAIN_ITER_BATCH: 1.0,
        M.TRAIN_STEPS_COMPLETED: 5,
        M.VALIDATION_STEP: 2.0,
        M.CHECKPOINT_SAVE: 0.5,
        M.CHECKPOINT_UPLOAD: 0.5,
    }
    progress = Progress(5, 0, 1, 5, loss=1.0, throughput=1.0, lr=0.01)
    ledger.progress_update(a1, progress, timers)
    ledger.finish(38.0)
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=40.0,
        config={},
        run_started=0.0,
    )
    g = summary.goodput
    b = g.buckets
    assert list(b.seconds()) == list(BUCKETS)
    assert list(summary.document()["goodput"]["buckets"]) == list(BUCKETS)
    assert sum(b.seconds().values()) == pytest.approx(40.0)
    assert b.startup == 12.0 and b.shutdown == 2.0  # launch->first step, end->exit
    assert (b.training, b.data_wait, b.validation, b.checkpoint) == (5.0, 1.0, 2.0, 1.0)
    assert (b.detection, b.restart) == (1.0, 4.0)  # kill->noticed, noticed->restart
    assert b.restore == pytest.approx(0.76)
    assert b.setup == pytest.approx(8.0 - 1.0 - 4.0 - 0.76 - 0.5)  # time-to-recover: 8 s
    assert b.redone == pytest.approx(2 * 6.0 / 5)  # 2 lost steps at 1.2 s each
    assert g.ettr == pytest.approx(5.0 / 40.0) == summary.metrics[M.GOODPUT_ETTR]


def test_a_just_in_time_checkpoint_inside_a_notice_window_is_counted_once():
    # Notice at 20 s, deadline at 30 s; the checkpoint of the step (4 s, in the checkpoint
    # timers) runs inside that window: the preemption bucket holds the other 6 s.
    failure = FailureRecord(
        attempt=1,
        time=30.0,
        kind="preemption",
        detection_s=0.0,
        recovered=True,
        recovery=Recovery(
            restart_s=3.0,
            restored_step=12,
            checkpoint="/ck/step_12",
            tier=None,
            holder=None,
            first_step_s=1.0,
            time_to_recover_s=8.0,
        ),
        preemption=PreemptionPart(
            jit=JitCheckpoint(12, seconds=4.0),
            notice=Notice(NoticeSource.drain, 20.0, 12, deadline=30.0),
        ),
    )
    timers = {M.TRAIN_STEP: 20.0, M.TRAIN_STEPS_COMPLETED: 20, M.CHECKPOINT_UPLOAD: 4.0}
    g = goodput(
        wall_s=60.0,
        run_started=0.0,
        first_step=5.0,
        finished=58.0,
        metrics=timers,
        failures=(failure,),
    )
    b = g.buckets
    assert b.preemption == 6.0 and b.checkpoint == 4.0
    assert b.other >= 0 and sum(b.seconds().values()) == pytest.approx(60.0)


def test_a_run_that_never_trained_is_all_startup():
    g = goodput(
        wall_s=9.0, run_started=0.0, first_step=None, finished=None, metrics={}, failures=()
    )
    assert g.ettr == 0.0 and g.buckets.startup == 9.0 and g.buckets.other == 0.0


def buckets(memory_snapshot_s: float = 0.0, **seconds: float) -> Goodput:
    return Goodput(
        wall_s=sum(seconds.values()),
        buckets=Buckets(**seconds),
        memory_snapshot_s=memory_snapshot_s,
    )


def test_the_model_predicts_the_measured_ettr_of_a_run_without_failures():
    run = buckets(startup=20.0, training=60.0, data_wait=10.0, checkpoint=7.0, validation=3.0)
    predicted = predict_ettr(run, checkpoints=7, failures=0, mtbf_s=None)
    assert predicted is not None and predicted.ettr == pytest.approx(60.0 / 100.0)
    assert predicted.checkpoint_cost_s == pytest.approx(1.0)
    assert predicted.interval_s == pytest.approx(10.0)
    assert predicted.optimal_interval_s is None  # no failure rate: no optimum
    assert predict_ettr(run, checkpoints=0, failures=0, mtbf_s=None) is None


def test_the_model_charges_each_expected_failure_its_recovery_and_half_an_interval():
    run = buckets(
        startup=10.0,
        training=80.0,
        checkpoint=8.0,
        detection=2.0,
        restart=4.0,
        setup=2.0,
        redone=4.0,
    )  # modeled: 100 s; 8 checkpoints of 1 s every 10 s; one failure costing 8 s
    predicted = predict_ettr(run, checkpoints=8, failures=1, mtbf_s=50.0)
    useful = (100.0 - 2 * (8.0 + 10.0 / 2)) / (1 + 1.0 / 10.0)  # two failures expected
    assert predicted is not None and predicted.expected_failures == pytest.approx(2.0)
    assert predicted.ettr == pytest.approx(useful / 110.0)
    assert predicted.optimal_interval_s == pytest.approx(math.sqrt(2 * 1.0 * 50.0))
    capped = predict_ettr(run, checkpoints=8, failures=1, mtbf_s=50.0, max_failures=1)
    assert capped is not None
    assert capped.expected_failures == 1.0 and capped.ettr > predicted.ettr
    exact = predict_ettr(run, checkpoints=8, failures=1, mtbf_s=None, max_failures=3)
    assert exact is not None and exact.expected_failures == 3.0


def test_with_the_memory_tier_a_failure_loses_half_a_snapshot_interval_not_a_checkpoints():
    # As above, and 80 snapshots (one a second of training) that stalled training 0.8 s in
    # all: the checkpoint bucket holds both tiers' stalls; a failure loses ~0.5 s, not 5 s.
    run = buckets(
        memory_snapshot_s=0.8,
        startup=10.0,
        training=80.0,
        checkpoint=8.8,
        detection=2.0,
        restart=4.0,
        setup=2.0,
        redone=0.4,
    )
    predicted = predict_ettr(run, checkpoints=8, failures=1, mtbf_s=50.0, snapshots=80)
    modeled = 80.0 + 8.8 + 2.0 + 4.0 + 2.0 + 0.4
    expected = modeled / 50.0
    restorable = 80.0 / (80 + 8)  # a snapshot or a checkpoint: either tier restores
    useful = (modeled - expected * (8.0 + restorable / 2)) / (1 + 8.8 / 80.0)
    assert predicted is not None
    assert predicted.checkpoint_cost_s == pytest.approx(1.0)  # the durable ones alone
    assert predicted.restorable_every_s == pytest.approx(restorable)
    assert predicted.ettr == pytest.approx(useful / (modeled + 10.0))
    # The cadence that loses least is the snapshots': for their cost, 0.01 s each.
    assert predicted.optimal_interval_s == pytest.approx(math.sqrt(2 * 0.01 * modeled / expected))
    without = predict_ettr(run, checkpoints=8, failures=1, mtbf_s=50.0)
    assert without is not None and without.ettr < predicted.ettr


def test_memory_snapshots_stall_training_in_the_checkpoint_bucket():
    run = goodput(
        wall_s=100.0,
        run_started=0.0,
        first_step=10.0,
        finished=100.0,
        metrics={
            M.TRAIN_STEPS_COMPLETED: 90,
            M.TRAIN_STEP: 80.0,
            M.CHECKPOINT_UPLOAD: 5.0,
            M.CHECKPOINT_MEMORY_SNAPSHOT_TIME: 2.0,
        },
        failures=(),
    )
    assert run.buckets.checkpoint == pytest.approx(7.0)
    assert run.memory_snapshot_s == pytest.approx(2.0)


def test_declared_failures_come_from_the_kill_schedule_or_the_expected_mtbf():
    kills = {"chaos": {"kind": "worker", "interval": 10.0, "max_kills": 2, "at_steps": []}}
    assert declared_failures(kills) == (10.0, 2)
    at = {"chaos": {"kind": "node", "interval": 10.0, "max_kills": 0, "at_steps": [5, 9]}}
    assert declared_failures(at) == (None, 2)
    slow = {"chaos": {"kind": "slow", "max_kills": 1}, "failure": {"expected_mtbf_s": 600.0}}
    assert declared_failures(slow) == (600.0, None)  # a straggler is no failure
    assert declared_failures({}) == (None, None)


def test_a_fixed_schedule_checkpoints_every_n_steps():
    every = CheckpointSchedule(10, None)
    assert [s for s in range(1, 35) if every.due(s)] == [10, 20, 30]
    assert not any(CheckpointSchedule(0, None).due(s) for s in range(1, 100))


def test_auto_probes_then_checkpoints_at_the_optimum_for_the_measured_cost():
    auto = CheckpointSchedule("auto", mtbf_s=200.0, probe_steps=10)
    assert not auto.due(9) and auto.due(10)
    # A 1 s checkpoint, 0.5 s steps, a failure every 200 s: tau* = 20 s = 40 steps.
    assert auto.saved(10, cost_s=1.0, step_s=0.5) == 50
    assert not auto.due(49) and auto.due(50)
    assert "every 40 steps" in auto.describe()
    assert auto.saved(50, cost_s=3.0, step_s=0.5) == 50 + 57  # mean cost 2 s: sqrt(800) s
    follower = CheckpointSchedule("auto", mtbf_s=200.0)
    follower.follow(107)  # the other ranks take rank 0's decision
    assert not follower.due(106) and follower.due(107)


def test_auto_needs_a_declared_failure_rate_and_nothing_else_is_a_word():
    base = {
        "model": {"_target_": "ftjob.models.SmallCNN"},
        "dataset": {"_target_": "ftjob.datasets.DigitsDataset"},
    }
    with pytest.raises(ConfigError, match="failure.expected_mtbf_s"):
        JobConfig(**base, trainer=TrainerConfig(checkpoint_every_n_steps="auto"))
    JobConfig(
        **base,
        trainer=TrainerConfig(checkpoint_every_n_steps="auto"),
        failure=FailureConfig(expected_mtbf_s=600.0),
    )
    for bad in ("sometimes", -1, True, 2.5):
        with pytest.raises(ConfigError, match="trainer.checkpoint_every_n_steps"):
            TrainerConfig(checkpoint_every_n_steps=bad)


def accounted(ledger, wall_s: float, run_started: float = 0.0) -> RunSummary:
    """summary.json's goodput for the ledger's records, as the driver builds it."""
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=wall_s,
        config={},
        run_started=run_started,
    )
    return summary


def assert_every_second_once(g: Goodput, wall_s: float) -> None:
    b = g.buckets.seconds()
    assert min(b.values()) >= 0, b
    assert sum(b.values()) == pytest.approx(wall_s)


def test_a_run_that_finished_without_a_step_is_not_counted_twice():
    # A resumed run with nothing left to do: restored at 110, finished at 112 (no step); the
    # driver started at 95 and ended at 122. It started up until it finished, then shut down.
    ledger = make_ledger()
    a0 = ledger.begin_attempt(110.0)
    ledger.restored(a0, restored(5))
    ledger.finish(112.0)
    g = accounted(ledger, wall_s=27.0, run_started=95.0).goodput
    assert_every_second_once(g, 27.0)
    assert g.buckets.startup == pytest.approx(17.0)
    assert g.buckets.shutdown == pytest.approx(10.0)


def test_steps_a_killed_node_still_trained_are_in_detection_not_also_redone():
    # 1 s a step. Steps 1-2 (12-14 s), the checkpoint of step 2 (14-15 s), steps 3-7
    # (15-20 s); the node is killed at 20 s, yet its workers live on to train steps 8-9
    # (20-22 s) before they die; noticed at 22.5 s. The restart trains steps 3-10 from 27 s,
    # commits the last checkpoint (35-36 s) and finishes; the driver ends at 40 s.
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(a0, FirstStep(1, 13.0, 1.0))
    train(ledger, a0, range(1, 3), audit=False)
    ledger.checkpoint(a0, CheckpointRecord(2, "/ck/step_2", None, 1.0, 15.0))
    train(ledger, a0, range(3, 8), audit=False)
    ledger.kill(Kill(20.0, "node", KillTarget("n1", ranks=(1,)), a0))
    train(ledger, a0, range(8, 10), audit=False)  # the dying node's workers, past the kill
    ledger.confirm_kill(20.0, True)
    ledger.failure_noticed(22.5, {1: "ActorDiedError"})
    a1 = ledger.begin_attempt(25.0)
    ledger.restored(a1, restored(2))  # 0.76 s
    ledger.first_step(a1, FirstStep(3, 28.0, 1.0))
    train(ledger, a1, range(3, 11), audit=False)
    timers = {
        M.TRAIN_STEP: 8.0,
        M.TRAIN_ITER_BATCH: 2.0,
        M.TRAIN_STEPS_COMPLETED: 10,
        M.CHECKPOINT_UPLOAD: 1.0,
    }
    progress = Progress(10, 0, 1, 10, loss=1.0, throughput=1.0, lr=0.01)
    ledger.progress_update(a1, progress, timers)
    ledger.checkpoint(a1, CheckpointRecord(10, "/ck/step_10", None, 1.0, 36.0))
    ledger.finish(36.0)
    summary = accounted(ledger, wall_s=40.0)
    g, (failure,) = summary.goodput, summary.failures
    assert (failure.kind, failure.lost_steps, failure.detection_s) == ("node_kill", 7, 2.5)
    assert failure.recovery is not None
    assert failure.recovery.lost_window_s == pytest.approx(
        6.0
    )  # the checkpoint's upload to the kill
    assert_every_second_once(g, 40.0)
    b = g.buckets
    assert b.redone == pytest.approx(6.0) and b.detection == pytest.approx(2.5)
    assert b.other == pytest.approx(0.0, abs=1e-9)


def test_an_attempt_that_died_starting_up_leaves_start_up_before_its_failure():
    # The first attempt (10 s) is killed at 15 s before its first step; noticed at 16 s; the
    # next one starts at 19 s, trains its first step 23-24 s and four more, ends at 30 s.
    ledger = make_ledger()
    ledger.begin_attempt(10.0)
    ledger.kill(Kill(15.0, "worker", KillTarget("n1", pid=1, rank=0), 0))
    ledger.failure_noticed(16.0, {0: "ActorDiedError"})
    a1 = ledger.begin_attempt(19.0)
    ledger.first_step(a1, FirstStep(1, 24.0, 1.0))
    train(ledger, a1, range(1, 6), audit=False)
    timers = {M.TRAIN_STEP: 4.0, M.TRAIN_ITER_BATCH: 1.0, M.TRAIN_STEPS_COMPLETED: 5}
    progress = Progress(5, 0, 1, 5, loss=1.0, throughput=1.0, lr=0.01)
    ledger.progress_update(a1, progress, timers)
    ledger.finish(30.0)
    summary = accounted(ledger, wall_s=32.0)
    g = summary.goodput
    assert_every_second_once(g, 32.0)
    b = g.buckets
    assert b.startup == pytest.approx(15.0)  # to the kill; then its recovery's buckets
    assert (b.detection, b.restart, b.setup) == pytest.approx((1.0, 3.0, 4.0))
    assert summary.timing.first_step == 24.0


def test_steps_a_killed_node_trained_that_a_memory_snapshot_kept_are_counted_once():
    # 1 s a step. Steps 1-7 (12-19 s); the node is killed at 19 s, its workers live on to
    # train steps 8-9 (19-21 s) and a memory snapshot keeps them; noticed at 21.5 s. The
    # restart (24 s) restores step 9 and trains step 10 (24-25 s); the driver ends at 29 s.
    # Nothing is redone, and steps 8-9 are training (the snapshot's timers hold them) -- not
    # detection too, which left other at -2 s.
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(a0, FirstStep(1, 13.0, 1.0))
    train(ledger, a0, range(1, 8), audit=False)
    ledger.kill(Kill(19.0, "node", KillTarget("n1", ranks=(1,)), a0))
    train(ledger, a0, range(8, 10), audit=False)
    ledger.confirm_kill(19.0, True)
    ledger.failure_noticed(21.5, {1: "ActorDiedError"})
    a1 = ledger.begin_attempt(24.0)
    ledger.restored(a1, dataclasses.replace(restored(9), download=0.0, load=0.0, skip=0.0))
    ledger.first_step(a1, FirstStep(10, 25.0, 1.0))
    train(ledger, a1, range(10, 11), audit=False)
    timers = {M.TRAIN_STEP: 10.0, M.TRAIN_STEPS_COMPLETED: 10}
    progress = Progress(10, 0, 1, 10, loss=1.0, throughput=1.0, lr=0.01)
    ledger.progress_update(a1, progress, timers)
    ledger.finish(25.0)
    g = accounted(ledger, wall_s=29.0).goodput
    assert_every_second_once(g, 29.0)
    b = g.buckets
    assert (b.startup, b.training, b.restart, b.shutdown, b.redone) == (12.0, 10.0, 2.5, 4.0, 0.0)
    assert b.detection == pytest.approx(0.5)  # 2.5 s, less the 2 s trained in them
    assert b.other == pytest.approx(0.0, abs=1e-9)
