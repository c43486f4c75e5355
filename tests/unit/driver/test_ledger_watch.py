"""The hang watch in the run ledger: it stops a restart loop, steers and restarts a straggler, and
watches only the attempt that runs. A test clock; no Ray."""

from __future__ import annotations

import pytest

from ftjob.driver.ledger import RunLedger
from ftjob.policy.hang import (
    WatchConfig,
)
from ftjob.record import (
    Kill,
    KillTarget,
    RunPlan,
    Straggler,
    WorkerPlace,
)
from tests.support.ledgers import HANG_POLICY as POLICY
from tests.support.ledgers import beat


def test_the_ledger_stops_a_restart_loop_and_steers_the_slow_rank():
    ledger = RunLedger(RunPlan(), watch=WatchConfig(POLICY, restart_loop_attempts=2))
    for i in range(2):
        assert ledger.start_attempt(float(i)).stop is None
    stop = ledger.start_attempt(2.0).stop
    assert stop is not None and ledger.fatal == stop
    ledger.register_worker(2, 1, WorkerPlace("n", 5, time=2.0))
    target = KillTarget("n", rank=1, pid=5)
    ledger.kill(Kill(time=3.0, kind="slow", target=target, attempt=2, slowdown=0.5))
    assert ledger.heartbeat(2, 1, beat("step", 0.0)) == 0.5
    assert ledger.heartbeat(2, 0, beat("step", 0.0)) == 0.0
    assert ledger.snapshot().watch.stragglers.max_slowdown == 0.0


def test_no_hang_is_declared_while_ray_train_restarts_a_failed_group():
    ledger = RunLedger(RunPlan(), watch=WatchConfig(POLICY))
    ledger.start_attempt(0.0)
    ledger.register_worker(0, 0, WorkerPlace("n", 5, time=0.0))
    ledger.failure_noticed(5.0, {0: "ActorDiedError: the node died"})
    assert ledger.check_watch(1000.0) == []  # silent for long, but the attempt is over
    ledger.start_attempt(30.0)
    ledger.register_worker(1, 0, WorkerPlace("n", 6, time=30.0))
    [hang] = ledger.check_watch(1000.0)  # the new attempt is watched
    assert hang.pid == 6 and hang.section == "setup"


def test_a_persistent_straggler_is_restarted_when_so_configured():
    config = WatchConfig(
        POLICY, straggler_threshold=1.3, straggler_patience=2, straggler_action="restart"
    )
    ledger = RunLedger(RunPlan(), watch=config)
    ledger.start_attempt(0.0)
    for rank, pid in ((0, 10), (1, 11)):
        ledger.register_worker(0, rank, WorkerPlace(f"n{rank}", pid, time=0.0))
    actions = []
    for t in range(1, 5):
        ledger.heartbeat(0, 0, beat("step", 0.0, step=t, local=[0.1] * 20))
        ledger.heartbeat(0, 1, beat("step", 0.0, step=t, local=[0.2] * 20))
        actions += ledger.check_watch(float(t))
    [restart] = actions
    assert isinstance(restart, Straggler) and restart.rank == 1 and restart.pid == 11
    assert restart.slowdown == pytest.approx(2.0) and restart.restarted
    assert ledger.check_watch(10.0) == []  # once, and no hang declared on top of it
    assert any("restarting the worker group" in line for line in ledger.lines)
