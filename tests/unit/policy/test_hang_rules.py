"""The rules that decide a hang, each on its own, and as HANG combines them: a Stall made by
hand (ranks, their timeouts, the clock), no detector."""

from __future__ import annotations

from ftjob.policy.hang_rules import (
    HANG,
    RankState,
    Rule,
    Stall,
    culprit,
    data_wait,
    group_moves,
    heartbeats_stopped,
    overdue,
    silent_after,
)

NOW = 1000.0
SILENT = silent_after(1.0)  # 5 s without a heartbeat


def rank(section: str, idle_s: float, quiet_s: float = 0.0, step: int = 10) -> RankState:
    """A rank ``idle_s`` seconds since its last progress, ``quiet_s`` since its last beat."""
    return RankState("node", 1, section, progress=NOW - idle_s, beat=NOW - quiet_s, step=step)


def stall(*ranks: RankState, timeout: float = 60.0) -> Stall:
    return Stall(NOW, dict(enumerate(ranks)), {r: timeout for r in range(len(ranks))}, SILENT)


def test_overdue_is_a_rank_past_its_timeout_without_progress():
    assert not overdue(stall(rank("step", 59), rank("step", 1)))
    assert overdue(stall(rank("step", 61), rank("step", 1)))
    untimed = Stall(NOW, {0: rank("done", 500)}, {}, SILENT)  # a finished rank has no timeout
    assert not overdue(untimed) and untimed.overdue == {}


def test_the_group_moves_while_any_rank_progressed_within_the_smallest_timeout():
    assert group_moves(stall(rank("step", 100), rank("checkpoint", 30)))
    assert not group_moves(stall(rank("step", 100), rank("checkpoint", 70)))
    mixed = Stall(NOW, {0: rank("step", 100), 1: rank("step", 30)}, {0: 20.0, 1: 60.0}, SILENT)
    assert not group_moves(mixed)  # 30 s ago is past the smallest timeout (20 s)


def test_a_data_wait_is_a_rank_within_its_timeout_waiting_for_its_batch():
    assert data_wait(stall(rank("step", 100), rank("data", 30)))
    assert not data_wait(stall(rank("step", 100), rank("data", 100)))  # overdue itself
    assert not data_wait(stall(rank("step", 100), rank("validation", 30)))
    assert data_wait(stall(rank("step", 100), rank("validation", 30, step=0)))  # a first window


def test_heartbeats_stopped_counts_only_overdue_ranks():
    assert heartbeats_stopped(stall(rank("step", 100, quiet_s=100), rank("data", 30)))
    assert not heartbeats_stopped(stall(rank("step", 100, quiet_s=1), rank("data", 30)))
    assert not heartbeats_stopped(stall(rank("step", 30, quiet_s=30)))  # quiet, not overdue


def test_hang_needs_an_overdue_rank_a_quiet_group_and_no_data_wait_but_a_stopped_process():
    assert not HANG(stall(rank("step", 30), rank("step", 30)))  # nobody overdue
    assert not HANG(stall(rank("step", 100), rank("checkpoint", 10)))  # rank 1 moves
    assert HANG(stall(rank("step", 100), rank("step", 100)))
    # Rank 1 waits for its data (within its 90 s), the group quiet past rank 0's 60 s: no hang
    waits, timeouts = rank("data", 70, quiet_s=1), {0: 60.0, 1: 90.0}
    assert not HANG(Stall(NOW, {0: rank("step", 100, quiet_s=1), 1: waits}, timeouts, SILENT))
    # ... unless the overdue rank's heartbeats stopped: a stopped process is a hang
    stopped = rank("step", 100, quiet_s=100)
    assert HANG(Stall(NOW, {0: stopped, 1: waits}, timeouts, SILENT))


def test_rules_combine_and_say_what_they_are():
    yes, no = Rule("yes", lambda s: True), Rule("no", lambda s: False)
    any_stall = stall(rank("step", 0))
    assert (yes | no)(any_stall) and not (yes & no)(any_stall) and (~no)(any_stall)
    assert repr(yes & ~no) == "(yes & ~no)"
    assert repr(HANG) == "((overdue & ~group_moves) & (heartbeats_stopped | ~data_wait))"


def test_the_culprit_is_a_stopped_rank_then_one_stuck_on_data_then_the_first_to_stall():
    assert culprit(stall(rank("step", 200), rank("step", 100, quiet_s=100))) == 1
    assert culprit(stall(rank("step", 200), rank("data", 100))) == 1
    assert culprit(stall(rank("step", 100), rank("step", 200))) == 1
    assert culprit(stall(rank("step", 200), rank("step", 100))) == 0
