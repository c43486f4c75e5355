"""A worker's heartbeat: its sections and steps, the pace a slowed rank keeps, and step times that
leave out the start-up. A test clock; no thread."""

from __future__ import annotations

import time

import pytest

from ftjob.config import (
    HangConfig,
    RetryConfig,
)
from ftjob.policy.hang import (
    HangPolicy,
    SectionTimes,
)
from ftjob.worker.heartbeat import Heartbeat


def test_heartbeat_sections_and_steps_without_a_thread():
    hb = Heartbeat(recorder=None, enabled=False)
    with hb.section("restore"):
        time.sleep(0.01)
    hb.enter("warmup")
    hb.step_started(0.0)
    hb.step_done(1)  # the first step ends the warm-up
    hb.step_started(0.0)
    hb.step_done(2)
    with hb.section("validation"):
        pass
    sent = hb._beat()
    assert sent.section == "data" and sent.step == 2  # waiting for its next batch
    assert set(sent.durations) == {"setup", "restore", "warmup", "data", "step", "validation"}
    assert len(sent.durations["step"]) == 1 and len(sent.local) == 1  # not the warm-up
    hb.step_started(0.0)
    assert hb._beat().section == "step"  # the batch came: computing
    assert sent.durations["restore"][0] >= 0.01


def test_a_slow_rank_sleeps_its_current_pace_not_its_start_up_pace(monkeypatch):
    # chaos=slow: the rank sleeps `slow` x its recent step time less what it slept. Its first
    # steps were 3x slower (they share the process with the stream's start-up); once it runs
    # at its own pace, the sleep follows that pace, and the local step time it reports is
    # (1 + slow) x the pace: the slowdown the user asked for.
    clock = {"now": 0.0}
    fake = type("FakeTime", (), {})()
    fake.perf_counter = lambda: clock["now"]
    fake.sleep = lambda s: clock.__setitem__("now", clock["now"] + s)
    monkeypatch.setattr("ftjob.worker.heartbeat.time", fake)
    hb = Heartbeat(recorder=None, enabled=False, sleep=fake.sleep)
    hb.enter("warmup")
    slept = []
    for step, compute in enumerate([0.3] * 6 + [0.1] * 40, start=1):
        if step == 4:
            hb.slow = 1.0  # chaos=slow reaches the rank while its steps are still slow
        hb.step_started(0.0)
        fake.sleep(compute)
        before = clock["now"]
        hb.straggle()
        slept.append(clock["now"] - before)
        hb.step_done(step)
    assert slept[:3] == [0.0, 0.0, 0.0]
    assert slept[-1] == pytest.approx(0.1)  # its pace now, not the 0.3 of its first steps
    assert hb._beat().local[-1] == pytest.approx(0.2)


def test_a_slow_start_does_not_stretch_the_step_timeout(monkeypatch):
    # An attempt's first steps share the process with its start-up (the first decode window):
    # 6.5 s each here, then 0.1 s. Learned from every step, the step timeout would be
    # 5 x 6.5 = 32.5 s (a stopped worker found past 30 s); from steady state it is the floor.
    clock = {"now": 0.0}
    fake = type("FakeTime", (), {})()
    fake.perf_counter = lambda: clock["now"]
    monkeypatch.setattr("ftjob.worker.heartbeat.time", fake)

    def learned_step_timeout(settle_steps: int) -> float | None:
        hb = Heartbeat(recorder=None, enabled=False, settle_steps=settle_steps)
        hb.enter("warmup")
        for step, compute in enumerate([6.5] * 6 + [0.1] * 60, start=1):
            hb.step_started(0.0)
            clock["now"] += compute
            hb.step_done(step)
        times = SectionTimes(HangPolicy.from_config(HangConfig(), RetryConfig()))
        times.observe("step", hb._beat().durations["step"])
        return times.timeout("step")

    assert learned_step_timeout(settle_steps=0) == pytest.approx(32.5)
    assert learned_step_timeout(settle_steps=HangConfig().settle_steps) == HangConfig().min_timeout
