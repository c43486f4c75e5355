"""The rules that decide a hang, as small named pieces (tenacity's style: a rule is a callable,
and rules combine with ``&``, ``|`` and ``~``).

A :class:`Stall` is the current attempt's ranks as the rules see them at one moment: each rank's
section, its last progress and heartbeat, and the timeout its section gives it. Each rule asks one
question of it:

- :data:`overdue`: some rank has made no progress for longer than its timeout;
- :data:`group_moves`: some rank still moves -- the others may be waiting for it (a slow upload on
  rank 0, a slow validation shard), so none of them is blamed;
- :data:`data_wait`: a rank that is not overdue waits for its next batch, within the time such
  waits take -- and the overdue ones may be waiting for it in the all-reduce;
- :data:`heartbeats_stopped`: an overdue rank's heartbeat thread went quiet too: its process is
  stopped or gone, a hang whatever the others wait for.

:data:`HANG` combines them; :func:`culprit` names the rank to blame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RankState:
    node_id: str
    pid: int
    section: str = "setup"
    progress: float = 0.0  # ledger clock: when the rank last made progress
    beat: float = 0.0  # ledger clock: its latest heartbeat
    step: int = 0
    io: int = -1  # storage requests completed, as of the latest heartbeat


def timed_as(rank: RankState) -> str:
    """The section whose timeout applies. A validation before the attempt's first step -- one
    a notice cut short, owed since the restore -- decodes its set cold (the validation cache
    fills once training flows; on a node that just joined, its decode processes start first):
    a stream's first window, timed as a data wait, not as the warm validations learned."""
    return "data" if rank.section == "validation" and rank.step == 0 else rank.section


def silent_after(heartbeat_interval: float) -> float:
    """Seconds without a heartbeat after which a rank's heartbeat thread counts as stopped:
    three missed beats, and slack for a loaded node."""
    return 3 * heartbeat_interval + 2.0


@dataclass(frozen=True)
class Stall:
    """The attempt's ranks at ``now``; ``timeouts``: each timed rank's (a rank in an untimed
    section -- preempted, done -- has none); ``silent``: :func:`silent_after`."""

    now: float
    ranks: dict[int, RankState]
    timeouts: dict[int, float]
    silent: float

    def stopped(self, rank: int) -> bool:
        """Its heartbeats stopped: the process is stopped or gone."""
        return self.now - self.ranks[rank].beat > self.silent

    @property
    def overdue(self) -> dict[int, float]:
        """Each rank past its timeout without progress: its timeout."""
        return {r: t for r, t in self.timeouts.items() if self.now - self.ranks[r].progress > t}


class Rule:
    """A question about a :class:`Stall`; ``a & b``, ``a | b`` and ``~a`` are rules too."""

    def __init__(self, name: str, test: Callable[[Stall], bool]) -> None:
        self.name, self.test = name, test

    def __call__(self, stall: Stall) -> bool:
        return self.test(stall)

    def __and__(self, other: Rule) -> Rule:
        return Rule(f"({self.name} & {other.name})", lambda s: self(s) and other(s))

    def __or__(self, other: Rule) -> Rule:
        return Rule(f"({self.name} | {other.name})", lambda s: self(s) or other(s))

    def __invert__(self) -> Rule:
        return Rule(f"~{self.name}", lambda s: not self(s))

    def __repr__(self) -> str:
        return self.name


def _group_moves(stall: Stall) -> bool:
    newest = max(s.progress for s in stall.ranks.values())
    return stall.now - newest <= min(stall.timeouts.values(), default=0.0)


def _data_wait(stall: Stall) -> bool:
    overdue = stall.overdue
    return any(timed_as(s) == "data" and r not in overdue for r, s in stall.ranks.items())


overdue = Rule("overdue", lambda stall: bool(stall.overdue))
group_moves = Rule("group_moves", _group_moves)
data_wait = Rule("data_wait", _data_wait)
heartbeats_stopped = Rule("heartbeats_stopped", lambda s: any(map(s.stopped, s.overdue)))

# A rank past its timeout while the whole group is quiet; a rank waiting for its data within
# the time waits take is not one -- unless an overdue rank's heartbeats stopped: a stopped
# process is a hang, and the data split the ranks share can be what the waiting rank waits on.
HANG = overdue & ~group_moves & (heartbeats_stopped | ~data_wait)


def culprit(stall: Stall) -> int:
    """The overdue rank to blame: one whose heartbeats stopped, then one stuck waiting for its
    data (the others wait for it in the all-reduce), then the one that stopped progressing
    first."""

    def suspicion(rank: int) -> tuple[bool, bool, float]:
        s = stall.ranks[rank]
        return (not stall.stopped(rank), timed_as(s) != "data", s.progress)

    return min(stall.overdue, key=suspicion)


__all__ = [
    "HANG",
    "RankState",
    "Rule",
    "Stall",
    "culprit",
    "data_wait",
    "group_moves",
    "heartbeats_stopped",
    "overdue",
    "silent_after",
    "timed_as",
]
