"""The drain relay: the driver tells every worker of a group, once per change, which of its nodes
drain and by when. No Ray: the workers are stand-ins."""

from __future__ import annotations

from typing import Any

from ftjob.driver.drains import DrainRelay


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
