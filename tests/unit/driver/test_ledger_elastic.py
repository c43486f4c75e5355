"""An elastic run's records in the run ledger: a shrink after a node loss and a planned grow, a
resize not agreed on in time, failures and stops during a resize, and a new resize request after
the last one's checkpoint. A ledger by hand; no Ray."""

from __future__ import annotations

import pytest

from ftjob import metrics as M
from ftjob.record import FirstStep, JitCheckpoint, Kill, KillTarget, Notice, RunStatus
from ftjob.reporting.run_summary import PlannedResize
from ftjob.reporting.summary import build_summary, format_summary
from ftjob.reporting.verdict import FitEnd, RunEnd, decide_status
from ftjob.worker.preemption import DRIVER, RESIZE
from tests.support.ledgers import make_ledger, restored, train


def agree_on_resize(ledger, attempt: int, step: int, received: float) -> None:
    """What rank 0 sends once every rank agreed on the policy's resize request."""
    ledger.preemption_notice(attempt, Notice(RESIZE, received, step))


def elastic_ledger(world: int):
    """A ledger of a run of at most 2 workers, its first attempt started on ``world``."""
    ledger = make_ledger(num_workers=2)
    return ledger, ledger.begin_attempt(0.0, world=world)


def shrunk_and_grown():
    """Attempt 0 on 2 workers dies with its node at step 7 (checkpoint at 5); attempt 1
    continues on 1 worker from step 5; capacity returns at step 12: a checkpoint of step 12,
    then attempt 2 on 2 workers from step 12."""
    ledger, a0 = elastic_ledger(2)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 8), audit=False)
    ledger.kill(Kill(10.0, "node", KillTarget("n2", ranks=(1,)), a0))
    ledger.confirm_kill(10.0, True)
    ledger.failure_noticed(11.0, {1: "ActorUnavailableError: node n2 unreachable"})
    a1 = ledger.begin_attempt(14.0, world=1)
    ledger.restored(a1, restored(5))
    ledger.first_step(a1, FirstStep(6, 16.0, took=0.5))
    train(ledger, a1, range(6, 13), audit=False)
    ledger.request_resize(1, 2, 30.0)
    assert ledger.notice_request() == RESIZE
    agree_on_resize(ledger, a1, step=12, received=30.5)
    assert not ledger.resize_checkpointed()
    ledger.jit_checkpoint(a1, JitCheckpoint(12, "/ck/step_12", seconds=0.2, time=31.0))
    assert ledger.resize_checkpointed()
    ledger.resize_executed(31.5)  # the policy hands Ray Train the resize
    a2 = ledger.begin_attempt(36.0, world=2)
    assert ledger.notice_request() is None  # served: the grown group is not asked again
    ledger.restored(a2, restored(12))
    ledger.first_step(a2, FirstStep(13, 40.0, took=0.5))
    train(ledger, a2, range(13, 20), audit=False)
    ledger.finish(50.0)
    return ledger


def test_a_shrink_after_a_node_loss_and_a_planned_grow_are_recorded_as_such():
    ledger = shrunk_and_grown()
    summary = build_summary(
        ledger.snapshot(),
        name="r",
        status=RunStatus.succeeded,
        error=None,
        wall_time_s=50,
        config={},
    )
    assert summary.world_sizes == (2, 1, 2)
    shrink, grow = summary.resizes
    assert (shrink.kind, shrink.from_, shrink.to, shrink.cause) == ("shrink", 2, 1, "failure")
    assert shrink.lost_steps == 2 and shrink.time_to_recover_s == pytest.approx(6.0)
    assert shrink.planned is None and "checkpoint" not in shrink.to_json()
    assert (grow.kind, grow.from_, grow.to, grow.cause) == ("grow", 1, 2, "planned")
    assert grow.lost_steps == 0 and grow.planned is not None
    assert grow.planned.checkpoint == "/ck/step_12" and grow.to_json()["from"] == 1
    assert grow.time_to_recover_s == pytest.approx(9.5)  # agreed at 30.5 -> first step at 40
    # The node kill is the one failure; the grow is not one (and is no preemption either).
    [failure] = summary.failures
    assert failure.kind == "node_kill" and failure.lost_steps == 2
    m = summary.metrics
    assert m[M.FAILURES_COUNT] == 1 and m[M.PREEMPTION_COUNT] == 0
    assert m[M.ELASTIC_RESIZES] == 2
    assert m[M.ELASTIC_TIME_BELOW_FULL] == pytest.approx(22.0)  # attempt 1: 14 -> 36
    assert summary.goodput.buckets.resize == pytest.approx(9.0)
    assert sum(summary.goodput.buckets.seconds().values()) == pytest.approx(50.0)
    lines = "\n".join(ledger.lines)
    assert "attempt 2: worker group shrunk from 2 to 1; continuing on 1 of 2 workers" in lines
    assert "attempt 3: worker group grown from 1 to 2" in lines
    assert "resizing from 1 to 2 workers at step 12" in lines
    assert "resize at attempt 3: grow 1 -> 2 workers (planned), lost 0 steps" in format_summary(
        summary
    )


def test_a_resize_the_workers_did_not_agree_on_in_time_is_still_planned_not_a_failure():
    ledger, a0 = elastic_ledger(1)
    ledger.first_step(a0, FirstStep(1, 1.0))
    train(ledger, a0, range(1, 9), audit=False)
    ledger.request_resize(1, 2, 10.0)
    ledger.resize_executed(130.0)  # timed out: resized without a checkpoint
    a1 = ledger.begin_attempt(134.0, world=2)
    assert ledger.notice_request() is None
    ledger.restored(a1, restored(5))
    ledger.first_step(a1, FirstStep(6, 140.0))
    train(ledger, a1, range(6, 10), audit=False)
    ledger.failure_noticed(150.0, {0: "ActorDiedError"})  # a real failure, later
    a2 = ledger.begin_attempt(156.0, world=2)
    ledger.restored(a2, restored(5))
    ledger.first_step(a2, FirstStep(6, 160.0))
    summary = build_summary(
        ledger.snapshot(), name="r", status=RunStatus.failed, error="x", wall_time_s=170, config={}
    )
    [grow] = summary.resizes
    assert (grow.cause, grow.lost_steps, grow.planned) == ("planned", 3, PlannedResize(None))
    assert grow.to_json()["checkpoint"] is None  # said: the workers did not agree in time
    assert grow.time_to_recover_s == pytest.approx(10.0)  # from the executed resize
    [failure] = summary.failures  # the failure belongs to the attempt it happened in
    assert failure.attempt == 2 and failure.error == "ActorDiedError"
    assert failure.lost_steps == 4


def test_a_failure_during_a_planned_resize_is_a_failure():
    ledger, a0 = elastic_ledger(1)
    train(ledger, a0, range(1, 5), audit=False)
    ledger.request_resize(1, 2, 10.0)
    agree_on_resize(ledger, a0, step=4, received=10.5)
    ledger.resize_executed(12.0)
    ledger.failure_noticed(12.5, {0: "ActorDiedError: node died"})  # before the teardown
    ledger.begin_attempt(20.0, world=2)
    snap = ledger.snapshot()
    assert [
        f.error
        for f in build_summary(
            snap, name="r", status=RunStatus.failed, error="x", wall_time_s=30, config={}
        ).failures
    ] == ["ActorDiedError: node died"]


def test_sigterm_while_workers_checkpoint_for_a_resize_makes_that_checkpoint_the_notice_s():
    ledger, a0 = elastic_ledger(1)
    train(ledger, a0, range(1, 4), audit=False)
    ledger.request_resize(1, 2, 5.0)
    agree_on_resize(ledger, a0, step=3, received=5.2)
    ledger.request_stop("SIGTERM", 5.3)
    ledger.jit_checkpoint(a0, JitCheckpoint(3, "/ck/step_3", seconds=0.2, time=5.6))
    notice = ledger.latest_preemption()
    assert notice is not None and notice.jit is not None and notice.jit.step == 3
    assert not ledger.resize_checkpointed()  # the policy does not resize a stopping run
    status, error = decide_status(ledger.snapshot(), FitEnd(RunEnd.PREEMPTED), 3)
    assert status == "preempted" and "just-in-time checkpoint of step 3" in error

    late = make_ledger()  # the stop came before the workers agreed on the resize
    a0 = late.begin_attempt(0.0, world=1)
    late.request_resize(1, 2, 5.0)
    late.request_stop("SIGTERM", 5.1)
    agree_on_resize(late, a0, step=3, received=5.2)
    notice = late.latest_preemption()
    assert notice is not None and notice.source == DRIVER and late.attempts[0].resize is None


def test_a_new_resize_is_not_taken_as_checkpointed_by_the_last_one_s_record():
    """Resized to 1 (all that could be placed), capacity is back before the new group's rank 0
    registered: the old attempt's record answers for the old request, not the new one."""
    ledger, a0 = elastic_ledger(2)
    ledger.request_resize(2, 2, 5.0)
    agree_on_resize(ledger, a0, step=3, received=5.2)
    ledger.jit_checkpoint(a0, JitCheckpoint(3, "/ck/step_3", seconds=0.2, time=5.6))
    assert ledger.resize_checkpointed()
    ledger.resize_executed(6.0)
    ledger.request_resize(1, 2, 7.0)  # before the resized group's begin_attempt
    assert not ledger.resize_checkpointed()
    ledger.request_stop("SIGTERM", 7.5)  # that resize was carried out: not the notice's
    first = ledger.attempts[0]
    assert first.resize and first.resize.jit and first.resize.jit.step == 3
    assert first.preemption is None
    said = [line for line in ledger.lines if line.startswith("capacity for")]
    assert said == [
        "capacity for 2 workers (running on 2): resizing",
        "capacity for 2 workers (running on 1): resizing",
    ]
