"""A simulated cluster's killed node comes back after ``ray.replace_delay`` seconds and, with
``ray.replace_after_steps``, once the group that went on without it trained that many steps
(ftjob.driver.cluster.replacement_due; the ledger's side: RunLedger.steps_trained)."""

from __future__ import annotations

from ftjob.driver.cluster import replacement_due
from ftjob.record import Kill, KillTarget
from tests.support.ledgers import make_ledger, restored, train


def node_kill(at: float = 100.0, attempt: int | None = 1, kind: str = "node") -> Kill:
    return Kill(time=at, kind=kind, target=KillTarget(node_id="n1", ranks=(0,)), attempt=attempt)


def test_without_steps_a_node_comes_back_replace_delay_seconds_after_the_kill() -> None:
    kill = node_kill(at=100.0)
    assert not replacement_due(kill, 114.9, (), delay=15.0, after_steps=None)
    assert replacement_due(kill, 115.0, (), delay=15.0, after_steps=None)


def test_a_worker_kill_brings_no_node_back() -> None:
    assert not replacement_due(node_kill(kind="worker"), 1e9, (), delay=0.0, after_steps=None)


def test_steps_count_only_in_the_attempts_after_the_one_the_kill_hit() -> None:
    kill = node_kill(attempt=1)  # the kill hit attempt 1, which trained on until it noticed
    # Attempt 1 trained 40 steps, some of them after the kill: none counts.
    assert not replacement_due(kill, 200.0, (12, 40), delay=0.0, after_steps=5)
    assert not replacement_due(kill, 200.0, (12, 40, 4), delay=0.0, after_steps=5)
    assert replacement_due(kill, 200.0, (12, 40, 5), delay=0.0, after_steps=5)
    # A second restart without the node: both smaller groups' steps count.
    assert replacement_due(kill, 200.0, (12, 40, 2, 3), delay=0.0, after_steps=5)


def test_with_steps_the_delay_still_holds() -> None:
    kill = node_kill(at=100.0, attempt=0)
    assert not replacement_due(kill, 105.0, (3, 50), delay=10.0, after_steps=5)
    assert replacement_due(kill, 110.0, (3, 50), delay=10.0, after_steps=5)


def test_a_preempted_node_counts_from_its_deadline() -> None:
    kill = node_kill(at=100.0, kind="preempt")
    kill = Kill(**{**kill.__dict__, "notice": 100.0, "deadline": 130.0})
    assert not replacement_due(kill, 129.0, (), delay=0.0, after_steps=None)
    assert replacement_due(kill, 130.0, (), delay=0.0, after_steps=None)


def test_the_ledger_counts_each_attempts_steps_from_its_restore() -> None:
    ledger = make_ledger(num_workers=2)
    first = ledger.begin_attempt(0.0, world=2)
    train(ledger, first, range(1, 8), audit=False)  # the kill's attempt: to step 7
    smaller = ledger.begin_attempt(10.0, world=1)
    ledger.restored(smaller, restored(5))
    assert ledger.steps_trained() == (7, 0)  # restored, nothing trained yet
    train(ledger, smaller, range(6, 9), audit=False)
    assert ledger.steps_trained() == (7, 3)
    kill = node_kill(attempt=first)
    assert replacement_due(kill, 200.0, ledger.steps_trained(), delay=0.0, after_steps=3)
    assert not replacement_due(kill, 200.0, ledger.steps_trained(), delay=0.0, after_steps=4)
