"""Preemption notices and their records, without Ray: a worker's local signals, the summary of
a preempted run, and the verdict when the driver itself is told to stop."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ftjob import metrics as M
from ftjob.chaos.schedule import ChaosKiller, KillSchedule
from ftjob.driver.drains import DrainRelay
from ftjob.record import FirstStep, JitCheckpoint, Kill, KillTarget, Notice, Restore
from ftjob.reporting.summary import FitOutcome, build_summary, decide_status
from ftjob.worker.preemption import DRAIN, DRIVER, WORKER, PreemptionNotices
from tests.helpers import WORKERS, make_ledger, train
from tests.helpers import FakeLedger as ChaosLedger


def test_a_drain_notice_carries_its_deadline_and_wins_over_nothing():
    drain: list = [None]  # what Ray Train's drain mark says, as the worker reads it
    notices = PreemptionNotices(world=1, device="cpu", drain_notice=lambda: drain[0])
    assert notices.agree() is None and not notices.noticed()
    drain[0] = (1_000_030.0, [1])
    notice = notices.agree()
    assert notice is not None and (notice.source, notice.deadline) == (DRAIN, 1_000_030.0)
    assert notice.remaining(1_000_000.0) == 30.0 and notices.drain_ranks == [1]


def test_a_driver_request_is_a_notice_without_a_deadline():
    notices = PreemptionNotices(world=1, device="cpu", drain_notice=lambda: None)
    notices.requested.set()  # what the ledger poller does when the driver got SIGTERM
    notice = notices.agree()
    assert notice is not None and notice.source == DRIVER and notice.deadline is None
    assert math.isinf(notice.remaining(0.0))


def test_sigterm_to_a_worker_is_a_notice_once_then_rays_exit_again(monkeypatch):
    import ray._private.worker as ray_worker

    exits: list[str] = []
    monkeypatch.setattr(
        ray_worker, "raise_sys_exit_with_custom_error_message", lambda m, c=1: exits.append(m)
    )
    original = ray_worker.raise_sys_exit_with_custom_error_message
    notices = PreemptionNotices(world=1, device="cpu", sigterm=True)
    # What Ray's SIGTERM handler calls on the worker's main thread:
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert exits == [] and notices.terminated.is_set()  # taken over: a notice, no exit
    notice = notices.agree()
    assert notice is not None and notice.source == WORKER and notice.deadline is None
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert exits == ["The process receives a SIGTERM."]  # a second one exits as Ray would
    notices.close()
    assert ray_worker.raise_sys_exit_with_custom_error_message is original


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
        ledger.snapshot(), name="r", status="succeeded", error=None, wall_time_s=50, config={}
    )
    [record] = summary["failures"]
    assert record["kind"] == "preemption" and record["lost_steps"] == 0
    assert record["jit"]["step"] == 12 and record["notice"]["deadline"] == 30.0
    assert record["time"] == 30.0  # the node went at its deadline
    assert record["time_to_recover_s"] == pytest.approx(15.0)
    m = summary["metrics"]
    assert m[M.FAILURES_COUNT] == 0  # not charged to the failure budget
    assert (m[M.PREEMPTION_COUNT], m[M.PREEMPTION_LOST_STEPS]) == (1, 0)
    assert m[M.PREEMPTION_JIT_CHECKPOINT_TIME] == pytest.approx(0.4)
    assert any("just-in-time checkpoint of step 12" in line for line in ledger.lines)


def test_more_preemptions_than_the_budget_fail_naming_it():
    snap = preempted_run().snapshot()
    fit = FitOutcome("PreemptionError: node n2 preempted", preemption_budget_exhausted=True)
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
    status, error = decide_status(ledger.snapshot(), FitOutcome(preempted=True), 3)
    assert status == "preempted"
    assert (
        error
        == "stopped by a preemption notice (SIGTERM) after a just-in-time checkpoint of step 3"
    )


def test_preempt_chaos_drains_then_counts_the_node_once_it_is_gone():
    ledger = ChaosLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    done: list[tuple[str, dict[str, Any]]] = []
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        "preempt",
        ledger,
        {"head"},
        notice=10.0,
        execute=lambda kind, target: done.append((kind, target)) or -1,
        confirm=lambda target: True,
        clock=lambda: 100.0,
        wait=lambda s: False,
    )
    [record] = killer.run()
    assert done[0][0] == "preempt" and done[0][1].node_id != "head"
    assert (record.notice, record.deadline) == (100.0, 110.0)
    assert ledger.confirmed == [(100.0, True)]


class _Worker:
    """A worker actor handle as the drain relay uses it: ``mark_preempt.remote(info)``."""

    def __init__(self) -> None:
        self.marked: list[Any] = []
        self.mark_preempt = type("Method", (), {"remote": self.marked.append})()


def test_the_drain_relay_marks_every_worker_once_per_change_of_the_groups_drained_nodes():
    drained: dict[str, int] = {}
    relay = DrainRelay(1.0, drains=lambda: dict(drained))
    group = {rank: _Worker() for rank in range(4)}
    relay.watch({"a": [1, 0], "b": [2, 3]}, group)
    assert relay.poll_once() is None  # nothing drains
    drained["c"] = 5_000  # another job's node
    assert relay.poll_once() is None
    drained["b"] = 7_000
    info = relay.poll_once()
    assert info.deadline_ms == 7_000 and info.preempted_node_to_ranks == {"b": [2, 3]}
    assert info.preempted_ranks == [2, 3]
    assert all(w.marked == [info] for w in group.values())  # every rank: they agree on it
    assert relay.poll_once() is None  # the same drain is relayed once
    drained["a"] = 0  # drained without a deadline: the earliest announced one stands
    both = relay.poll_once()
    assert both.deadline_ms == 7_000 and both.preempted_ranks == [0, 1, 2, 3]
    # A new worker group on the same nodes is told at once; after its shutdown, nobody is.
    regrouped = {rank: _Worker() for rank in range(2)}
    relay.watch({"a": [0], "d": [1]}, regrouped)
    assert relay.poll_once().preempted_node_to_ranks == {"a": [0]}
    assert all(len(w.marked) == 1 for w in regrouped.values())
    relay.watch({}, {})
    drained["d"] = 9_000
    assert relay.poll_once() is None
    assert all(len(w.marked) == 1 for w in regrouped.values())
    # A drain with no deadline at all.
    relay.watch({"e": [0]}, {0: _Worker()})
    drained["e"] = 0
    assert relay.poll_once().deadline_ms is None
