"""Hang detection, straggler scores and the restart-loop guard, driven with a test clock."""

from __future__ import annotations

import pytest

from ftjob.config import (
    ChaosConfig,
    ConfigError,
    FailureConfig,
    HangConfig,
    JobConfig,
    RetryConfig,
)
from ftjob.policy.hang import (
    HangDetector,
    HangPolicy,
    SectionTimes,
    StragglerScores,
    restart_loop,
)
from ftjob.record import (
    Attempt,
    Notice,
    NoticeSource,
)
from tests.support.ledgers import HANG_POLICY as POLICY
from tests.support.ledgers import beat


def test_a_section_timeout_is_learned_from_its_own_times_within_floor_and_ceiling():
    times = SectionTimes(POLICY)
    assert times.timeout("step") == 300.0  # not learned yet: the ceiling
    times.observe("step", [0.1, 0.12])
    assert not times.learned("step")
    times.observe("step", [0.11] * 10 + [1.0])
    assert times.timeout("step") == 10.0  # 5 x p99 (5 s) is under the floor
    times.observe("validation", [4.0, 5.0, 6.0])
    assert times.timeout("validation") == pytest.approx(30.0)  # 5 x the high percentile
    times.observe("checkpoint", [100.0] * 3)
    assert times.timeout("checkpoint") == 300.0  # capped
    assert times.timeout("preempted") is None  # waiting to be torn down is never a hang


def test_io_sections_get_at_least_what_one_storage_request_may_take():
    retry = RetryConfig(deadline=120.0, max_backoff=20.0)
    policy = HangPolicy.from_config(HangConfig(min_timeout=10.0), retry)
    times = SectionTimes(policy)
    times.observe("checkpoint", [0.5] * 5)
    times.observe("step", [0.5] * 5)
    assert times.timeout("checkpoint", io=True) == 140.0  # the retry deadline + one backoff
    assert times.timeout("checkpoint") == 10.0  # a rank that only waits for the writer
    assert times.timeout("step", io=True) == 10.0
    explicit = SectionTimes(HangPolicy.from_config(HangConfig(timeout=7.0), retry))
    assert explicit.timeout("step") == 7.0
    assert explicit.table()["step"].learned is False


def detector(policy: HangPolicy = POLICY) -> HangDetector:
    d = HangDetector(policy, SectionTimes(policy))
    d.times.observe("step", [0.2] * 10)  # learned: 10 s (the floor)
    d.register(0, 0, "nodeA", 100, now=0.0)
    d.register(0, 1, "nodeB", 101, now=0.0)
    return d


def test_a_stopped_rank_is_found_after_its_timeout_and_named_over_the_waiting_one():
    d = detector()
    for t in range(1, 6):  # both train; rank 1 stops at t=5 (no heartbeat after)
        d.beat(0, 0, beat("step", 0.1, step=t), now=float(t))
        d.beat(0, 1, beat("step", 0.1, step=t), now=float(t))
    for t in range(6, 15):  # rank 0 waits in the all-reduce: its beats go on, no progress
        d.beat(0, 0, beat("step", t - 4.9, step=5), now=float(t))
        assert d.check(float(t)) is None
    hang = d.check(15.0)  # 10.1 s after the last progress: past the 10 s timeout
    assert hang is not None
    assert hang.rank == 1 and hang.node_id == "nodeB" and hang.pid == 101
    assert hang.heartbeats_stopped and hang.section == "step" and hang.learned
    assert hang.stalled_for_s == pytest.approx(10.1)
    assert hang.detection_latency_s == pytest.approx(0.1)  # how late past the timeout
    assert d.check(30.0) is None  # once per attempt
    d.register(1, 0, "nodeA", 200, now=40.0)  # the next attempt starts clean
    assert d.check(41.0) is None


def test_no_hang_while_any_rank_moves_or_a_slow_upload_progresses():
    policy = HangPolicy(min_timeout=10.0, max_timeout=300.0, io_timeout=0.0)
    d = detector(policy)
    d.times.observe("checkpoint", [1.0] * 5)  # learned: 10 s
    for t in range(1, 60):  # rank 0 uploads slowly (a request completes every 5 s)
        d.beat(0, 0, beat("checkpoint", 0.0 if t == 1 else t - 1, io=t // 5), now=float(t))
        d.beat(0, 1, beat("checkpoint", t - 1.0), now=float(t))  # rank 1 waits for it
        assert d.check(float(t)) is None, t
    d2 = detector(policy)
    for t in range(1, 60):  # a deadlocked pair: heartbeats go on, progress does not
        d2.beat(0, 0, beat("step", float(t)), now=float(t))
        d2.beat(0, 1, beat("step", float(t) - 0.5), now=float(t))
    hang = d2.check(60.0)
    assert hang is not None and hang.rank == 0 and not hang.heartbeats_stopped


def test_late_heartbeats_of_an_earlier_attempt_are_ignored():
    d = detector()
    d.register(1, 0, "nodeA", 300, now=50.0)
    d.beat(0, 1, beat("step", 0.0, durations={"step": [99.0]}), now=51.0)
    assert d.ranks.keys() == {0}
    assert len(d.times.observed["step"]) == 10


def test_a_persistently_slow_rank_is_a_straggler_with_its_slowdown():
    scores = StragglerScores(threshold=1.3, patience=3, window=10)
    for check in range(7):  # rank 1 turns slow at check 2 (its window is half slow then)
        scores.add(0, 0, [0.10] * 5)
        scores.add(0, 1, [0.15] * 5 if check >= 2 else [0.10] * 5)
        new = scores.check(float(check), {0: "a", 1: "b"})
        if check < 5:
            assert new == []
        if check == 5:
            assert [f.rank for f in new] == [1]
            assert new[0].slowdown == pytest.approx(1.5)
            assert new[0].vs_own_best == pytest.approx(1.5)
    assert scores.max_slowdown() == pytest.approx(1.5)
    steady = StragglerScores(threshold=1.3, patience=3, window=10)
    for check in range(6):
        steady.add(0, 0, [0.10] * 10)
        steady.add(0, 1, [0.11] * 10)
        assert steady.check(float(check), {}) == []
    assert steady.max_slowdown() == pytest.approx(1.1)
    assert StragglerScores(1.3, 3).max_slowdown() == 0.0  # one rank: never scored


def attempts(*steps: tuple[int, bool]) -> list[Attempt]:
    notice = Notice(NoticeSource.driver, 0.0, 0)
    return [
        Attempt(i, float(i), max_step=s, preemption=notice if p else None)
        for i, (s, p) in enumerate(steps)
    ]


def test_restart_loop_needs_n_attempts_in_a_row_without_progress():
    run = attempts((0, False), (0, False), (0, False), (0, False))  # the 4th just started
    assert "3 attempts in a row" in restart_loop(run, 3, 1)
    assert restart_loop(run[:3], 3, 1) is None  # only two have ended
    assert restart_loop(run, 0, 1) is None  # guard off
    # Each attempt reaches step 7 again after restoring step 0: no progress past 7.
    again = attempts((7, False), (7, False), (7, False), (0, False))
    assert restart_loop(again, 2, 1) is not None
    assert restart_loop(again, 3, 1) is None  # the first one made progress
    moving = attempts((10, False), (20, False), (30, False), (0, False))
    assert restart_loop(moving, 3, 1) is None
    assert restart_loop(moving, 3, 11) is not None
    preempted = attempts((5, False), (5, True), (5, False), (0, False))
    assert restart_loop(preempted, 2, 1) is None  # a preemption is not a failure


def test_hang_chaos_needs_hang_detection():
    with pytest.raises(ConfigError, match="failure.hang.enabled"):
        JobConfig(
            model={"_target_": "ftjob.models.SmallCNN"},
            dataset={"_target_": "ftjob.datasets.DigitsDataset"},
            chaos=ChaosConfig(kind="hang", max_kills=1),
            failure=FailureConfig(hang=HangConfig(enabled=False)),
        )


def test_failure_keys_spelled_the_old_way_still_work_and_say_their_new_name(capsys, monkeypatch):
    import ftjob.config.legacy
    from tests.support.jobs import compose_job

    monkeypatch.setattr(ftjob.config.legacy, "_said", set())  # said once per process: this one's

    job = compose_job(
        "failure.hang_timeout=7", "failure.straggler_patience=4", "failure.restart_loop_attempts=2"
    )
    f = job.failure
    assert (f.hang.timeout, f.straggler.patience, f.restart_loop.attempts) == (7.0, 4, 2)
    assert f.hang_timeout is None  # read only through its new home
    err = capsys.readouterr().err
    assert "failure.hang_timeout is deprecated: it is failure.hang.timeout now" in err
    assert "failure.restart_loop_attempts is deprecated" in err
    with pytest.raises(ConfigError, match="failure.hang.timeout"):  # the rules apply to them too
        compose_job("failure.hang_timeout=-1")


def test_a_rank_waiting_long_for_its_data_is_no_hang_and_neither_is_the_rank_waiting_for_it():
    # A decode window that takes 40 s to start (new processes on a loaded node): rank 1 waits
    # for its batch, rank 0 waits for rank 1 in the all-reduce. Neither is hung.
    d = detector(HangPolicy(min_timeout=10.0, data_min_timeout=10.0, max_timeout=300.0))
    d.times.observe("step", [0.2] * 5)
    d.times.observe("data", [1.0] * 5)  # learned: waits time out after 10 s...
    d.times.observe("data", [9.0])  # ...a slow one seen: 45 s
    d.beat(0, 0, beat("step", 0.0), now=1.0)
    d.beat(0, 1, beat("data", 0.0), now=1.0)
    for t in range(2, 41):
        d.beat(0, 0, beat("step", t - 1.0), now=float(t))
        d.beat(0, 1, beat("data", t - 1.0), now=float(t))
    assert d.check(40.0) is None
    for t in range(41, 50):  # rank 1's wait outlasts what waits take: that is a hang
        d.beat(0, 0, beat("step", t - 1.0), now=float(t))
        d.beat(0, 1, beat("data", t - 1.0), now=float(t))
    hang = d.check(50.0)
    assert hang is not None and hang.rank == 1 and hang.section == "data"


def test_a_rank_stopped_while_rank_0_writes_a_checkpoint_is_found_at_its_own_timeout():
    policy = HangPolicy(min_timeout=10.0, max_timeout=300.0, io_timeout=300.0)
    d = detector(policy)
    d.times.observe("checkpoint", [0.5] * 5)  # learned: 10 s, but 300 s for rank 0's upload
    d.beat(0, 0, beat("checkpoint", 0.0, io=3), now=1.0)
    d.beat(0, 1, beat("checkpoint", 0.0), now=1.0)  # then rank 1 stops
    for t in range(2, 12):  # rank 0 committed and waits for rank 1 in the agreement
        d.beat(0, 0, beat("checkpoint", t - 1.0, io=4), now=float(t))
    hang = d.check(12.5)  # 10 s after rank 0's last request: the group is quiet
    assert hang is not None and hang.rank == 1 and hang.timeout_s == 10.0


def test_rank_0_stopped_while_it_writes_a_checkpoint_is_named_not_the_rank_waiting_for_it():
    policy = HangPolicy(min_timeout=10.0, max_timeout=300.0, io_timeout=300.0)
    d = detector(policy)
    d.times.observe("checkpoint", [0.5] * 5)  # learned: 10 s for rank 1, 300 s for rank 0
    d.beat(0, 0, beat("checkpoint", 0.0, io=3), now=1.0)  # then rank 0 is stopped (SIGSTOP)
    for t in range(1, 13):  # rank 1 waits for rank 0's commit in the agreement
        d.beat(0, 1, beat("checkpoint", t - 1.0), now=float(t))
    hang = d.check(12.5)
    assert hang is not None and hang.rank == 0 and hang.heartbeats_stopped
    assert hang.timeout_s == 10.0  # the floor: a silent process is not a slow upload


def test_a_rank_stopped_while_it_waited_for_data_is_found_at_the_floor_not_the_learned_wait():
    d = detector(HangPolicy(min_timeout=10.0, max_timeout=300.0))
    assert d.times.timeout("data") == 300.0  # not learned: the ceiling
    d.times.observe("data", [0.1] * 5)  # a quick pipeline, but waits get the data floor...
    assert d.times.timeout("data") == 120.0
    for t in range(1, 4):  # rank 0 stops while waiting for its batch: its heartbeats end too
        d.beat(0, 0, beat("data", 0.5), now=float(t))
        d.beat(0, 1, beat("step", 0.1), now=float(t))
    for t in range(4, 16):  # rank 1 waits for it in the all-reduce
        d.beat(0, 1, beat("step", t - 2.9), now=float(t))
    hang = d.check(15.0)
    assert hang is not None and hang.rank == 0 and hang.heartbeats_stopped
    assert hang.timeout_s == 10.0


def test_a_stopped_rank_is_found_at_the_floor_while_the_other_waits_for_its_data():
    # Rank 1 is stopped mid-step (SIGSTOP); rank 0 is left waiting for its next batch, which
    # the data split they share holds back until every rank asks. The waiting rank's data
    # timeout (120 s) must not hide the stopped one.
    d = detector(HangPolicy(min_timeout=10.0, max_timeout=300.0))
    d.times.observe("data", [0.1] * 5)
    d.times.observe("step", [0.2] * 5)
    for t in range(1, 4):
        d.beat(0, 0, beat("step", 0.1, step=t), now=float(t))
        d.beat(0, 1, beat("step", 0.1, step=t), now=float(t))
    found = {}
    for t in range(4, 20):  # rank 0 beats on, in its data wait; rank 1 is silent
        d.beat(0, 0, beat("data", t - 3.0, step=3), now=float(t))
        if (hang := d.check(float(t))) is not None:
            found[t] = hang
    [(t, hang)] = found.items()
    assert t == 14  # the 10 s floor past the last progress (2.9), not the data wait's 120 s
    assert hang.rank == 1 and hang.heartbeats_stopped and hang.timeout_s == 10.0
    assert hang.others == {0: "data"}


def test_a_validation_owed_before_the_attempts_first_step_is_timed_as_a_first_data_window():
    # A grow's notice cut the epoch-end validation short; the grown group runs it before its
    # first step, its set decoded cold on the node that just joined: 25 s, not the 0.2 s the
    # warm validations took (learned: 10 s).
    d = detector(HangPolicy(min_timeout=10.0, data_min_timeout=120.0, max_timeout=300.0))
    d.times.observe("validation", [0.2] * 5)
    for t in range(1, 27):
        d.beat(0, 0, beat("validation", t - 1.0, step=0), now=float(t))
        d.beat(0, 1, beat("validation", t - 1.0, step=0), now=float(t))
    assert d.check(26.0) is None
    # The same wait in a validation after training steps is a hang at the learned 10 s.
    d.register(1, 0, "nodeA", 200, now=30.0)
    d.register(1, 1, "nodeB", 201, now=30.0)
    for t in range(31, 43):
        d.beat(1, 0, beat("validation", t - 31.0, step=66), now=float(t))
        d.beat(1, 1, beat("validation", t - 31.0, step=66), now=float(t))
    hang = d.check(42.0)
    assert hang is not None and hang.section == "validation" and hang.timeout_s == 10.0
