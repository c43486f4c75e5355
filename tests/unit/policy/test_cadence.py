"""The memory tier's snapshot cadence (``checkpoint.memory.every_n_steps``): a fixed interval,
or ``auto`` -- the shortest interval whose measured cost stays within a share of step time.
(The storage checkpoint's ``auto``: tests/unit/reporting/test_goodput.py and the checkpointer's.)"""

from __future__ import annotations

import math

import pytest

from ftjob.policy.cadence import SnapshotCadence, snapshot_interval


@pytest.mark.parametrize(
    "cost_s, step_s, max_overhead, interval",
    [
        (0.002, 0.1, 0.02, 1),  # 2 ms of a 100 ms step is 2 %: every step
        (0.0021, 0.1, 0.02, 2),  # a little more: every other step
        (0.2, 0.1, 0.02, 100),  # a ResNet-50 state on a fast step: 200 ms / (2 % of 100 ms)
        (0.2, 0.1, 0.05, 40),  # a larger share: shorter
        (0.2, 1.0, 0.02, 10),  # a slower step: shorter
        (0.0, 0.1, 0.02, 1),  # free
        (0.2, 0.0, 0.02, 1),  # no step time yet: every step until one is known
    ],
)
def test_the_interval_is_the_shortest_within_the_share_of_step_time(
    cost_s: float, step_s: float, max_overhead: float, interval: int
) -> None:
    assert snapshot_interval(cost_s, step_s, max_overhead) == interval
    if step_s > 0 and interval > 1:  # within the share, and one step fewer would not be
        assert cost_s / (interval * step_s) <= max_overhead
        assert cost_s / ((interval - 1) * step_s) > max_overhead


def test_a_fixed_interval_is_every_n_steps_and_ignores_costs() -> None:
    cadence = SnapshotCadence(3, max_overhead=0.02)
    assert [s for s in range(1, 10) if cadence.due(s)] == [3, 6, 9]
    assert cadence.measured(10.0, 0.001) is False  # said nothing, changed nothing
    assert [s for s in range(10, 16) if cadence.due(s)] == [12, 15]


def test_auto_probes_then_follows_the_measured_costs() -> None:
    cadence = SnapshotCadence("auto", max_overhead=0.02, probe_steps=5)
    # The probe: 5 steps into the attempt (it started at step 40, restored), a step's time known.
    assert [cadence.due(s) for s in range(41, 46)] == [False] * 4 + [True]
    cadence.taken(45)
    # Until its background work ends, its cost is unknown: no other snapshot is due.
    assert not any(cadence.due(s) for s in range(46, 200))
    assert cadence.next_step == math.inf
    # 10 ms (copy and background) on 100 ms steps at 2 %: every 5 steps; chosen once, said.
    assert cadence.measured(0.010, 0.100) is True
    assert cadence.interval_steps == 5 and cadence.next_step == 50
    assert "every 5 steps" in cadence.describe() and "max_overhead=0.02" in cadence.describe()
    assert cadence.due(50) and not cadence.due(49)
    cadence.taken(50)
    # A dearer snapshot (30 ms): the mean of the costs so far (20 ms) sets it, not said again.
    assert cadence.measured(0.030, 0.100) is False
    assert cadence.interval_steps == 10 and cadence.next_step == 60
    cadence.taken(60)
    cadence.measured(0.002, 0.100)  # then cheap ones bring it down
    for step in range(61, 80):
        cadence.taken(step)
        cadence.measured(0.002, 0.100)
    assert cadence.interval_steps == 1  # the last 20, all 2 ms: every step


def test_a_probe_that_set_up_the_tier_is_taken_again_and_its_cost_is_not_kept() -> None:
    # The first snapshot of an attempt opens the holder's memory (and page-locks it on a GPU):
    # hundreds of milliseconds, once. Weighed as a snapshot's cost, it would space the next
    # ones by thousands of steps.
    cadence = SnapshotCadence("auto", max_overhead=0.02, probe_steps=5)
    assert [s for s in range(1, 8) if cadence.due(s)][:1] == [5]
    cadence.taken(5)
    cadence.again()
    assert cadence.due(6) and cadence.costs == [] and cadence.interval_steps is None
    cadence.taken(6)
    assert cadence.measured(0.001, 0.100) is True and cadence.interval_steps == 1
    fixed = SnapshotCadence(3, max_overhead=0.02)
    fixed.taken(3)
    fixed.again()  # a fixed interval is kept
    assert [s for s in range(4, 10) if fixed.due(s)] == [6, 9]
