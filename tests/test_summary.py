"""summary.json figures from a ledger, built by hand (no Ray)."""

from __future__ import annotations

import json

import pytest

from ftjob import metrics as M
from ftjob.reporting.failures import failure_records
from ftjob.reporting.summary import (
    FitOutcome,
    audit_batches,
    audit_report,
    build_summary,
    decide_status,
    format_summary,
    write_summary,
)
from tests.helpers import PLAN, make_ledger, restored, train


def test_failure_records_measure_each_part_of_recovery():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(100.0)
    ledger.first_step(a0, 1, 110.0)
    train(ledger, a0, range(1, 5))
    ledger.kill({"time": 120.0, "kind": "node", "target": {"node_id": "n1", "ranks": [0]}})
    ledger.failure_noticed(125.0, {0: "ActorDiedError: node died"})
    ledger.confirm_kill(120.0, True)  # Ray marks the node dead after the failure is noticed
    a1 = ledger.begin_attempt(130.0)
    ledger.restored(a1, restored(2))
    parts = {"process_group": 0.4, "model": 1.2, "first_batch": 0.1, "first_step": 0.3}
    ledger.first_step(a1, 3, 134.0, 0.4, parts)
    train(ledger, a1, range(3, 6))
    ledger.finish(140.0)
    [f] = failure_records(ledger.snapshot())
    assert f["phases"] == parts and f["first_step_s"] == 0.4
    assert f["kind"] == "node_kill" and f["recovered"]
    assert f["detection_s"] == pytest.approx(5.0)
    assert f["restart_s"] == pytest.approx(5.0)
    assert f["time_to_recover_s"] == pytest.approx(14.0)
    assert f["restoration_s"] == pytest.approx(0.76)
    assert f["lost_steps"] == 2  # trained to step 4, restored step 2


def test_budget_exhausted_failure_is_not_recovered():
    ledger = make_ledger()
    ledger.begin_attempt(0.0)
    ledger.claim_injected_failure(3, 5.0)
    ledger.failure_noticed(6.0, {0: "InjectedFailure: step 3"})
    [f] = failure_records(ledger.snapshot())
    assert f["kind"] == "injected" and not f["recovered"] and f["detection_s"] == pytest.approx(1.0)
    assert not ledger.claim_injected_failure(3, 7.0)  # each injected failure fires once


def test_summary_has_every_metric_key_json_safe_and_audit_excludes_lost_work(tmp_path):
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.first_step(a0, 1, 1.0)
    train(ledger, a0, range(1, 5))  # steps 3-4 are lost: the next attempt restores step 2
    ledger.failure_noticed(5.0, {0: "boom"})
    a1 = ledger.begin_attempt(6.0)
    ledger.restored(a1, restored(2))
    ledger.first_step(a1, 3, 7.0)
    train(ledger, a1, range(3, 6))
    ledger.validation(a0, 4, {"epoch": 0, "loss": 1.0, "accuracy": 0.5})
    ledger.validation(
        a1, 4, {"epoch": 0, "loss": 0.5, "accuracy": 0.75}
    )  # replaces, not duplicates
    ledger.progress_update(
        a1,
        {"step": 5, "epoch": 0, "epochs": 1, "total_steps": 5, "loss": 0.1, "throughput": 9.0},
        {M.TRAIN_ROWS_PROCESSED: 40, M.TRAIN_STEP: 2.0, M.TRAIN_ITER_BATCH: float("inf")},
    )
    ledger.checkpoint(a1, {"step": 5, "path": "/ck/step_5", "error": None, "seconds": 0.1})
    ledger.finish(9.0)
    summary = build_summary(
        ledger.snapshot(), name="r", status="succeeded", error=None, wall_time_s=9.0, config={}
    )
    assert set(M.METRIC_KEYS) <= set(summary["metrics"])
    assert summary["metrics"][M.VALIDATION_ACCURACY] == 0.75 and summary["validation_replaced"] == 1
    assert [v["step"] for v in summary["validation"]] == [4]
    assert summary["metrics"][M.CHECKPOINT_RESTORATION_TIME] == pytest.approx(0.76)
    assert summary["checkpoints"]["committed"] == 1
    assert summary["audit"] == [
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
    text = open(write_summary(summary, str(tmp_path))).read()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["status"] == "succeeded"


def test_audit_catches_a_replayed_batch():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6))
    ledger.audit_step(a0, 5, 0, PLAN.shard(0, 0, 0, 1)[:8].tolist())  # step 5 saw batch 0 again
    [a] = build_summary(
        ledger.snapshot(), name="r", status="failed", error="x", wall_time_s=1, config={}
    )["audit"]
    assert a["duplicates"] == 8 and a["missing"] == 0


# -- the verdict: a pure function of the ledger snapshot and how fit() ended ----------------


def finished_snapshot(fatal: str | None = None, finished: bool = True) -> dict:
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
    assert decide_status(finished_snapshot(), FitOutcome(), max_failures=3) == ("succeeded", None)


def test_a_fatal_upload_failure_fails_the_run_with_its_reason():
    fatal = "2 checkpoint upload(s) in a row failed (checkpoint.max_consecutive_upload_failures=1)"
    status, error = decide_status(
        finished_snapshot(fatal=fatal, finished=False), FitOutcome(), max_failures=3
    )
    assert (status, error) == ("failed", fatal)


def test_an_exhausted_failure_budget_names_count_and_budget():
    fit = FitOutcome("ActorDiedError: worker killed", budget_exhausted=True)
    status, error = decide_status(finished_snapshot(finished=False), fit, max_failures=0)
    assert status == "failed"
    assert error == (
        "training failed after 1 failure(s), over the budget failure.max_failures=0: "
        "ActorDiedError: worker killed"
    )


def test_fit_raising_for_another_reason_fails_with_that_error():
    fit = FitOutcome("ControllerError: storage marker missing")
    assert decide_status(finished_snapshot(), fit, 3) == (
        "failed",
        "ControllerError: storage marker missing",
    )


def test_a_run_that_ended_before_its_last_step_is_not_a_success():
    assert decide_status(finished_snapshot(finished=False), FitOutcome(), 3) == (
        "failed",
        "training ended before the last epoch",
    )


def test_an_interrupted_run_says_so_whatever_else_happened():
    status, error = decide_status(finished_snapshot(), FitOutcome(interrupted=True), 3)
    assert status == "interrupted" and "Ctrl-C" in error


def test_a_finished_run_whose_audit_shows_a_replayed_batch_failed():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6))
    ledger.audit_step(a0, 5, 0, PLAN.shard(0, 0, 0, 1)[:8].tolist())  # step 5 saw batch 0 again
    ledger.finish(9.0)
    status, error = decide_status(ledger.snapshot(), FitOutcome(), 3)
    assert status == "failed"
    assert error.startswith("exact-once broken: epoch 0 trained 8 duplicate, 0 missing")


def test_steps_that_trained_each_other_s_batch_fail_the_run_though_every_sample_came_once():
    """At any world size step k trains the data order's k-th global batch; two steps that
    swapped batches keep the epoch's sample set but are not the same training."""
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 4))
    for step, batch in ((4, 5), (5, 4)):
        ledger.audit_step(a0, step, 0, PLAN.shard(0, (batch - 1) * 8, 0, 1)[:8].tolist())
        ledger.step_done(a0, step)
    ledger.finish(9.0)
    snap = ledger.snapshot()
    [epoch] = audit_report(snap)
    assert (epoch["duplicates"], epoch["missing"], epoch["misplaced"]) == (0, 0, 2)
    status, error = decide_status(snap, FitOutcome(), 3)
    assert status == "failed" and "2 step(s) not on their global batch" in error
    steps = [step for step, _ in audit_batches(snap)]
    assert steps == [1, 2, 3, 4, 5]


def test_a_resumed_run_expects_only_the_samples_after_its_resume_position():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.restored(a0, restored(2))  # an earlier run trained steps 1-2 (samples 0-15)
    ledger.first_step(a0, 3, 1.0)
    train(ledger, a0, range(3, 6))
    ledger.finish(9.0)
    snap = ledger.snapshot()
    [a] = build_summary(snap, name="r", status="x", error=None, wall_time_s=1, config={})["audit"]
    assert (a["resumed_at"], a["unique"], a["missing"], a["duplicates"]) == (16, 24, 0, 0)
    assert decide_status(snap, FitOutcome(), 3) == ("succeeded", None)


def test_non_finite_values_are_null_in_the_summary_and_its_printout(tmp_path):
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 6), audit=False)
    progress = {"step": 5, "epoch": 0, "epochs": 1, "total_steps": 5, "throughput": 9.0}
    ledger.progress_update(a0, {**progress, "loss": float("nan")}, {M.TRAIN_LOSS: float("nan")})
    ledger.validation(a0, 5, {"epoch": 0, "loss": float("inf"), "accuracy": 0.1})
    summary = build_summary(
        ledger.snapshot(), name="r", status="failed", error="x", wall_time_s=1, config={}
    )
    assert summary["metrics"][M.TRAIN_LOSS] is None
    assert summary["metrics"][M.VALIDATION_LOSS] is None
    assert (
        json.loads(open(write_summary(summary, str(tmp_path))).read())["metrics"][M.TRAIN_LOSS]
        is None
    )
    assert "loss null" in "\n".join(ledger.lines) and "train loss null" in format_summary(summary)


def test_chaos_that_did_not_happen_is_in_the_summary_with_its_reason():
    ledger = make_ledger()
    ledger.begin_attempt(0.0)
    ledger.kill({"time": 5.0, "kind": "node", "target": {"node_id": "n1", "ranks": [0]}})
    ledger.kill({"time": 9.0, "kind": "node", "target": {"node_id": "n2", "ranks": [1]}})
    ledger.confirm_kill(5.0, False)
    ledger.chaos_skipped({"time": 7.0, "kind": "node", "window": 2, "reason": "no eligible target"})
    summary = build_summary(
        ledger.snapshot(), name="r", status="x", error=None, wall_time_s=1, config={}
    )
    assert summary["chaos"]["kills"] == [] and summary["metrics"][M.CHAOS_KILLS] == 0
    reasons = [s["reason"] for s in summary["chaos"]["skipped"]]
    assert reasons == [
        "the node was not confirmed dead",
        "no eligible target",
        "not confirmed dead before the run ended",
    ]
    assert any("chaos: no node kill: no eligible target" in line for line in ledger.lines)
    assert "  chaos: no node kill: no eligible target" in format_summary(summary).splitlines()
