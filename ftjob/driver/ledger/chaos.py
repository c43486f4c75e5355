"""The run ledger's chaos part: every kill, skipped window and injected failure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ftjob.chaos.schedule import describe_chaos
from ftjob.config import NODE_KINDS
from ftjob.record import Attempt, ChaosSkip, ChaosView, Injected, Kill


class ChaosLog:
    """Kills carried out (a node kill counts once Ray confirmed its node gone, and is pending
    until then), windows that ended without one, and failures injected at chosen steps."""

    def __init__(self, fail_at_steps: list[int], log: Callable[[str], None]) -> None:
        self.log = log
        self.kills: list[Kill] = []  # confirmed
        self.pending: list[Kill] = []  # node kills not yet confirmed
        self.skipped: list[ChaosSkip] = []
        self.injected: list[Injected] = []
        self.due_failures = set(fail_at_steps)

    def claim_injected_failure(self, step: int, now: float) -> bool:
        """True once per step in chaos.fail_at_steps: that worker then raises."""
        if step not in self.due_failures:
            return False
        self.due_failures.discard(step)
        self.injected.append(Injected(time=now, step=step))
        self.log(f"chaos: injected failure at step {step}")
        return True

    def kill(self, record: Kill) -> None:
        pending = record.kind in NODE_KINDS
        entry = dataclasses.replace(record, confirmed=not pending)
        (self.pending if pending else self.kills).append(entry)
        self.log(describe_chaos(record, len(self.kills)))

    def confirm(self, time_of_kill: float, confirmed: bool) -> None:
        entry = next((k for k in self.pending if k.time == time_of_kill), None)
        if entry is None:
            return
        self.pending.remove(entry)
        what = f"node {entry.target.node_id[:12]} (ranks {list(entry.target.ranks or ())})"
        if confirmed:
            self.kills.append(dataclasses.replace(entry, confirmed=True))
            self.kills.sort(key=lambda k: k.time)
            self.log(f"chaos: kill {len(self.kills)}: {what} is gone")
        else:
            self.skip(ChaosSkip.of_kill(entry, "the node was not confirmed dead"))

    def skip(self, record: ChaosSkip) -> None:
        self.skipped.append(record)
        self.log(f"chaos: no {record.kind} kill: {record.reason}")

    def all_kills(self) -> list[Kill]:
        """Every kill carried out, pending node kills included (to replace their nodes)."""
        return sorted(self.kills + self.pending, key=lambda k: k.time)

    def skipped_at_end(self) -> list[ChaosSkip]:
        return self.skipped + [
            ChaosSkip.of_kill(k, "not confirmed dead before the run ended") for k in self.pending
        ]


def chaos_view(attempts: list[Attempt], done: bool) -> ChaosView:
    """What the chaos killer needs (``done``: nothing left to interrupt)."""
    if not attempts:
        return ChaosView(training_started=None, attempt=None, training=False, workers=(), step=0)
    first, latest = attempts[0].first_step, attempts[-1]
    workers = tuple(
        dataclasses.replace(place, rank=rank) for rank, place in sorted(latest.workers.items())
    )
    return ChaosView(
        training_started=first.time if first else None,
        attempt=latest.index,
        training=latest.first_step is not None and not done,
        workers=workers,
        step=latest.max_step,
        started_at=attempts[0].restored.step if attempts[0].restored else 0,
    )
