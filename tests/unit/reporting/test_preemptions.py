"""A preempted run's records: a preemption with its just-in-time checkpoint is no failure, a
budget of preemptions, and the verdict when the driver itself is told to stop. A ledger by hand;
no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from ftjob import metrics as M
from ftjob.record import FirstStep, JitCheckpoint, Kill, KillTarget, Notice, Restore, RunStatus
from ftjob.reporting.summary import build_summary
from ftjob.reporting.verdict import FitEnd, RunEnd, decide_status
from ftjob.worker.preemption import DRAIN, DRIVER
from tests.support.ledgers import make_ledger, train


def preempted_run() -> Any:
    """Attempt 0 is preempted at step 12 with a JIT checkpoint of step 12; attempt 1 resumes."""
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 13), audit=False)
    node = KillTarget("n1", ranks=(1,))
    ledger.kill(Kill(20.0, "preempt", node, a0, notice=20.0, deadline=30.0))
    ledger.preemption_notice(a0, Notice(DRAIN, 21.0, 12, deadline=30.0, ranks=(1,)))
    ledger.jit_checkpoint(a0, JitCheckpoint(12, "/ck/step_12", seconds=0.4, time=21.5))
    ledger.failure_noticed(31.0, {1: "ActorDiedError: node preempted"})
    ledger.confirm_kill(20.0, True)
    a1 = ledger.begin_attempt(40.0)
    ledger.restored(a1, Restore(12, 0, 96, "/ck/step_12", download=0.1, load=0.1, skip=0.0))
    ledger.first_step(a1, FirstStep(13, 45.0))
    train(ledger, a1, range(13, 16), audit=False)
    ledger.finish(50.0)
    return ledger


def test_a_preempted_attempt_is_a_preemption_record_not_a_failure():
    ledger = preempted_run()
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=50,
        config={},
    )
    [record] = summary.failures
    assert record.kind == "preemption" and record.lost_steps == 0
    part = record.preemption
    assert part is not None and part.jit is not None and part.jit.step == 12
    assert part.notice.deadline == 30.0 and part.notice.jit is None  # the record has it
    assert record.time == 30.0  # the node went at its deadline
    assert record.time_to_recover_s == pytest.approx(15.0)
    m = summary.metrics
    assert m[M.FAILURES_COUNT] == 0  # not charged to the failure budget
    assert (m[M.PREEMPTION_COUNT], m[M.PREEMPTION_LOST_STEPS]) == (1, 0)
    assert m[M.PREEMPTION_JIT_CHECKPOINT_TIME] == pytest.approx(0.4)
    assert any("just-in-time checkpoint of step 12" in line for line in ledger.lines)


def test_more_preemptions_than_the_budget_fail_naming_it():
    snap = preempted_run().snapshot()
    fit = FitEnd(RunEnd.PREEMPTIONS_EXHAUSTED, "PreemptionError: node n2 preempted")
    status, error = decide_status(snap, fit, max_failures=3, max_preemptions=0)
    assert status == "failed"
    assert error.startswith("training stopped after 1 preemption(s), over the budget")
    assert "failure.max_preemptions=0" in error


def test_a_driver_stopped_by_sigterm_is_preempted_and_names_its_checkpoint():
    ledger = make_ledger()
    a0 = ledger.begin_attempt(0.0)
    train(ledger, a0, range(1, 4), audit=False)
    ledger.request_stop("SIGTERM", 5.0)
    assert ledger.stop_requested()
    ledger.preemption_notice(a0, Notice(DRIVER, 5.2, 3))
    ledger.jit_checkpoint(a0, JitCheckpoint(3, "/ck/step_3", seconds=0.2, time=5.5))
    status, error = decide_status(ledger.snapshot(), FitEnd(RunEnd.PREEMPTED), 3)
    assert status == "preempted"
    assert (
        error
        == "stopped by a preemption notice (SIGTERM) after a just-in-time checkpoint of step 3"
    )
