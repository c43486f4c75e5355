"""Kill schedule and killer logic with an injected clock: no Ray, no sleeping."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ftjob.chaos.schedule import ChaosKiller, KillSchedule, choose_target, eligible_targets
from ftjob.config import ChaosConfig
from ftjob.record import (
    Beat,
    KillTarget,
    RunPlan,
    WorkerPlace,
)
from tests.support.ledgers import WORKERS, FakeLedger


def test_schedule_same_seed_same_times_and_one_kill_per_window():
    s = KillSchedule(interval=10, max_kills=3, start_delay=5, jitter=True, seed=4)
    times = s.times()
    assert times == KillSchedule(10, 3, 5, True, 4).times()
    assert times != KillSchedule(10, 3, 5, True, 5).times()
    for k, t in enumerate(times):
        assert 5 + 10 * k <= t < 5 + 10 * (k + 1)


def test_schedule_without_jitter_kills_at_window_ends():
    assert KillSchedule(interval=480, max_kills=2, jitter=False).times() == [480, 960]
    assert KillSchedule.from_config(ChaosConfig(kind="node", interval=3, max_kills=0)).times() == []


def test_targets_never_include_protected_nodes():
    assert len(eligible_targets("worker", WORKERS, {"head"})) == 4  # processes, not nodes
    targets = eligible_targets("node", WORKERS, {"head"})
    assert {w.node_id for w in targets} == {"n1", "n2"}
    node = choose_target("node", targets, random.Random(0))
    assert node.node_id in {"n1", "n2"}
    assert node.ranks == ((1, 2) if node.node_id == "n1" else (3,))
    worker = choose_target("worker", targets, random.Random(0))
    assert worker.node_id != "head" and worker.pid in {11, 12, 13}


@pytest.mark.parametrize("seed", range(4))
def test_chaos_target_rank0_hits_rank_0_or_its_node_and_any_other_when_it_is_protected(seed):
    rank0_on_n2 = [
        WorkerPlace(node_id="n1", pid=11, rank=1),
        WorkerPlace(node_id="n2", pid=13, rank=0),
    ]
    rng = random.Random(seed)
    node = choose_target("node", rank0_on_n2, rng, "rank0")
    assert (node.node_id, node.ranks) == ("n2", (0,))
    assert choose_target("worker", rank0_on_n2, rng, "rank0").pid == 13
    # Rank 0 on the head (never a node kill's target): the kill hits another node.
    targets = eligible_targets("node", WORKERS, {"head"})
    assert choose_target("node", targets, rng, "rank0").node_id in {"n1", "n2"}
    assert ChaosConfig(kind="node", target="rank0").target == "rank0"


class FakeTime:
    """A clock that only moves when the killer waits; a hook runs at each wait."""

    def __init__(self, hook: Any) -> None:
        self.now, self.hook = 1000.0, hook

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.now += max(seconds, 0.01)
        self.hook(self.now)
        return False


def test_killer_waits_for_training_then_kills_once_per_attempt():
    ledger = FakeLedger()
    kills: list[tuple[str, dict[str, Any]]] = []

    def world(now: float) -> None:
        if now >= 1003 and ledger.view["training_started"] is None:  # first step at t=1003
            ledger.view.update(training_started=1003.0, attempt=0, training=True, workers=WORKERS)
        if kills and ledger.view["attempt"] == 0 and now >= kills[-1][1]["time"] + 20:
            ledger.view.update(attempt=1, training=True)  # recovered 20 s after the kill

    t = FakeTime(world)

    def execute(kind: str, target: KillTarget) -> int:
        kills.append((kind, {"target": target, "time": t.now}))
        ledger.view["training"] = False  # the attempt dies
        return 99

    schedule = KillSchedule(interval=10, max_kills=2, jitter=False)
    killer = ChaosKiller(
        schedule,
        ["node"],
        ledger,
        {"head"},
        execute=execute,
        confirm=lambda target: True,
        clock=t.clock,
        wait=t.wait,
        poll_s=0.5,
    )
    records = killer.run()
    assert len(records) == 2 == len(ledger.recorded)
    assert ledger.confirmed == [(r.time, True) for r in records]
    assert records[0].time == pytest.approx(1013, abs=0.6)  # 10 s after the first step
    assert records[1].attempt == 1  # the second kill waited for the recovered attempt
    assert records[1].time >= records[0].time + 20
    assert all(r.target.node_id != "head" for r in records)


def test_killer_stops_when_told():
    ledger = FakeLedger()
    killer = ChaosKiller(
        KillSchedule(10, 2), ["worker"], ledger, set(), execute=lambda k, t: 0, wait=lambda s: True
    )
    assert killer.run() == []


def test_failed_kill_is_not_counted_but_recorded_with_its_reason():
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS[1:2])
    calls = []

    def execute(kind: str, target: KillTarget) -> int:
        calls.append(target)
        if len(calls) == 1:
            raise ProcessLookupError("gone")
        ledger.view["attempt"] += 1
        return 1

    clock = iter(range(0, 10_000)).__next__
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        ["worker"],
        ledger,
        set(),
        execute=execute,
        clock=lambda: float(clock()),
        wait=lambda s: False,
    )
    assert len(killer.run()) == 0 and len(calls) == 1
    [skip] = ledger.skipped
    assert "ProcessLookupError: gone" in skip.reason and skip.window == 1


def test_a_window_without_an_eligible_target_is_skipped_and_says_why():
    ledger = FakeLedger()
    on_head = [WorkerPlace("head", 10, rank=0), WorkerPlace("head", 11, rank=1)]
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=on_head)
    clock = iter(range(0, 10_000)).__next__
    killer = ChaosKiller(
        KillSchedule(1, 2, jitter=False),
        ["node"],
        ledger,
        {"head"},
        execute=lambda kind, target: pytest.fail("nothing may be killed"),
        clock=lambda: float(clock()),
        wait=lambda s: False,
    )
    assert killer.run() == []
    assert [s.window for s in ledger.skipped] == [1, 2]  # each window: a kill or a reason
    assert all("no eligible target" in s.reason for s in ledger.skipped)


def test_a_node_kill_that_is_not_confirmed_is_not_counted():
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        ["node"],
        ledger,
        {"head"},
        execute=lambda kind, target: -1,
        confirm=lambda target: False,
        clock=lambda: 5.0,
        wait=lambda s: False,
    )
    assert killer.run() == []
    assert len(ledger.recorded) == 1 and ledger.confirmed == [(5.0, False)]


def test_kills_at_steps_wait_for_the_step_not_the_clock():
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    kills: list[int] = []

    def world(now: float) -> None:
        ledger.view["step"] += 1  # one step per wait
        if kills and ledger.view["attempt"] == len(kills) - 1:
            ledger.view.update(attempt=len(kills), step=kills[-1] - 2)  # restored 2 steps back

    t = FakeTime(world)

    def execute(kind: str, target: KillTarget) -> int:
        kills.append(ledger.view["step"])
        return 1

    killer = ChaosKiller(
        KillSchedule(interval=1e9, max_kills=0),
        ["worker"],
        ledger,
        set(),
        at_steps=[5, 12],
        execute=execute,
        clock=t.clock,
        wait=t.wait,
    )
    assert len(killer.run()) == 2
    assert kills == [5, 12]


def test_a_continued_run_skips_the_kills_at_steps_its_earlier_driver_had_passed():
    """The same command run again after a driver's death (resume=auto) keeps its schedule by
    step: kills at steps the run had trained past were the dead driver's."""
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    ledger.view.update(step=21, started_at=20)  # this driver restored step 20
    kills: list[int] = []

    def world(now: float) -> None:
        ledger.view["step"] += 1
        if kills and ledger.view["attempt"] == len(kills) - 1:
            ledger.view["attempt"] = len(kills)

    t = FakeTime(world)

    def execute(kind: str, target: KillTarget) -> int:
        kills.append(ledger.view["step"])
        return 1

    killer = ChaosKiller(
        KillSchedule(interval=1e9, max_kills=0),
        ["worker"],
        ledger,
        set(),
        at_steps=[5, 20, 25, 30],
        execute=execute,
        clock=t.clock,
        wait=t.wait,
    )
    assert len(killer.run()) == 2
    assert kills == [25, 30]  # not one at once for each step already passed
    assert [s.window for s in ledger.skipped] == [1, 2]
    assert all("trained past step" in s.reason for s in ledger.skipped)


def test_a_broken_killer_reports_instead_of_dying_silently():
    ledger = FakeLedger()
    ledger.view.update(
        training_started=0.0, attempt=0, training=True, workers=[object()]
    )  # not a worker's place
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        ["node"],
        ledger,
        set(),
        execute=lambda kind, target: 0,
        clock=lambda: 5.0,
        wait=lambda s: False,
    )
    assert killer.run() == []
    assert ledger.errors and "chaos killer stopped" in ledger.errors[0]


def test_slow_chaos_picks_a_rank_and_the_ledger_steers_its_heartbeat_to_sleep():
    from ftjob.driver.ledger import RunLedger

    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    clock = iter(range(0, 10_000)).__next__
    signals: list[str] = []
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        ["slow"],
        ledger,
        set(),
        slowdown=1.0,
        execute=lambda kind, target: signals.append(kind) or 0,
        clock=lambda: float(clock()),
        wait=lambda s: False,
    )
    [record] = killer.run()
    assert record.kind == "slow" and record.slowdown == 1.0 and signals == ["slow"]
    rank = record.target.rank
    run = RunLedger(RunPlan())
    run.start_attempt(0.0)
    run.kill(record)  # the rank's heartbeat answer tells it to sleep; no other rank's does
    assert run.heartbeat(0, rank, Beat("step", 0.0, 1)) == 1.0
    other = next(w.rank for w in WORKERS if w.rank != rank)
    assert run.heartbeat(0, other, Beat("step", 0.0, 1)) == 0.0
    assert [k.kind for k in run.snapshot_kills()] == ["slow"]


def test_preempt_chaos_drains_then_counts_the_node_once_it_is_gone():
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    done: list[tuple[str, dict[str, Any]]] = []
    killer = ChaosKiller(
        KillSchedule(1, 1, jitter=False),
        ["preempt"],
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


def test_mixed_chaos_takes_the_kinds_of_chaos_mix_in_turn():
    ledger = FakeLedger()
    ledger.view.update(training_started=0.0, attempt=0, training=True, workers=WORKERS)
    done: list[str] = []

    def execute(kind: str, target: KillTarget) -> int:
        done.append(kind)
        ledger.view["attempt"] += 1  # each kill's attempt is over; the next one trains
        return 1

    clock = iter(range(0, 10_000)).__next__
    kinds = ChaosConfig(kind="mixed", mix=["worker", "node", "slow"]).kinds()
    killer = ChaosKiller(
        KillSchedule(1, 5, jitter=False),
        [k.value for k in kinds],
        ledger,
        {"head"},
        execute=execute,
        clock=lambda: float(clock()),
        wait=lambda s: False,
    )
    records = killer.run()
    assert done == ["worker", "node", "slow", "worker", "node"]
    assert [r.kind for r in records] == done  # each record names its own kind
    assert all(r.target.node_id != "head" for r in records if r.kind == "node")


def test_a_mix_is_checked_kind_by_kind():
    with pytest.raises(Exception, match="chaos.mix"):
        ChaosConfig(kind="mixed", mix=["worker", "mixed"])
    with pytest.raises(Exception, match="chaos.mix"):
        ChaosConfig(kind="mixed", mix=[])
    assert ChaosConfig(kind="worker", max_kills=1).kinds() == ["worker"]
    assert not ChaosConfig(kind="mixed", mix=["worker", "slow"], max_kills=2).takes_nodes()
    assert ChaosConfig(kind="mixed", mix=["worker", "preempt"], max_kills=2).takes_nodes()
