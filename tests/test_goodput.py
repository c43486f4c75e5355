"""Goodput: every second of a run's wall clock in one bucket (no Ray: a ledger by hand)."""

from __future__ import annotations

import pytest

from ftjob import metrics as M
from ftjob.goodput import BUCKETS, goodput
from ftjob.summary import build_summary
from tests.test_summary import make_ledger, restored, train


def test_buckets_sum_to_the_wall_clock_and_name_each_cause():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(10.0)
    ledger.first_step(a0, 1, 13.0, 1.0)  # its first batch and step: data_wait and training
    train(ledger, a0, range(1, 5), audit=False)  # steps 3-4 are lost with the failure
    ledger.kill({"time": 20.0, "kind": "worker", "target": {"rank": 0, "pid": 1}})
    ledger.failure_noticed(21.0, {0: "ActorDiedError"})
    a1 = ledger.begin_attempt(25.0)
    ledger.restored(a1, restored(2))  # download 0.5, load 0.25, skip 0.01
    ledger.first_step(a1, 3, 28.0, 0.5)  # its batch wait and step: data_wait and training
    train(ledger, a1, range(3, 6), audit=False)
    timers = {
        M.TRAIN_STEP: 5.0,
        M.TRAIN_ITER_BATCH: 1.0,
        M.TRAIN_STEPS_COMPLETED: 5,
        M.VALIDATION_STEP: 2.0,
        M.CHECKPOINT_SAVE: 0.5,
        M.CHECKPOINT_UPLOAD: 0.5,
    }
    progress = {"step": 5, "epoch": 0, "epochs": 1, "total_steps": 5, "loss": 1.0}
    ledger.progress_update(a1, {**progress, "throughput": 1.0}, timers)
    ledger.finish(38.0)
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status="succeeded",
        error=None,
        wall_time_s=40.0,
        config={},
        run_started=0.0,
    )
    g = summary["goodput"]
    b = g["buckets"]
    assert list(b) == list(BUCKETS)
    assert sum(b.values()) == pytest.approx(40.0)
    assert b["startup"] == 12.0 and b["shutdown"] == 2.0  # launch->first step, end->exit
    assert (b["training"], b["data_wait"], b["validation"], b["checkpoint"]) == (5.0, 1.0, 2.0, 1.0)
    assert (b["detection"], b["restart"]) == (1.0, 4.0)  # kill->noticed, noticed->restart
    assert b["restore"] == pytest.approx(0.76)
    assert b["setup"] == pytest.approx(8.0 - 1.0 - 4.0 - 0.76 - 0.5)  # time-to-recover: 8 s
    assert b["redone"] == pytest.approx(2 * 6.0 / 5)  # 2 lost steps at 1.2 s each
    assert g["ettr"] == pytest.approx(5.0 / 40.0) == summary["metrics"][M.GOODPUT_ETTR]


def test_a_run_that_never_trained_is_all_startup():
    g = goodput(
        wall_s=9.0, run_started=0.0, first_step=None, finished=None, metrics={}, failures=[]
    )
    assert g["ettr"] == 0.0 and g["buckets"]["startup"] == 9.0 and g["buckets"]["other"] == 0.0
