"""Run ledgers by hand: a short run's plan and records (steps, audits, restores), the workers'
places, and the ledger as the chaos killer sees it."""

from __future__ import annotations

from typing import Any

from ftjob.data.order import EpochPlan
from ftjob.driver.ledger import RunLedger
from ftjob.policy.hang import HangPolicy
from ftjob.record import Beat, ChaosSkip, ChaosView, Kill, Restore, RunPlan, WorkerPlace

PLAN = EpochPlan(num_samples=40, global_batch_size=8, seed=0)


def make_ledger(num_workers: int | None = None) -> RunLedger:
    """A ledger of a run of 5 steps of 8 samples (at most ``num_workers``: elastic)."""
    return RunLedger(
        RunPlan(
            num_samples=PLAN.num_samples,
            global_batch_size=8,
            samples_per_epoch=PLAN.samples_per_epoch,
            steps_per_epoch=PLAN.steps_per_epoch,
            seed=0,
            epochs=1,
            num_workers=num_workers,
        ),
        fail_at_steps=[3],
    )


def train(ledger: RunLedger, attempt: int, steps: range, audit: bool = True) -> None:
    for step in steps:
        ledger.step_done(attempt, step)
        if audit:
            ids = PLAN.shard(0, (step - 1) * 8, 0, 1)[:8]
            ledger.audit_step(attempt, step, 0, ids.tolist(), [])


def restored(step: int) -> Restore:
    """A restore of the checkpoint of ``step`` from storage: 0.76 s in all."""
    return Restore(
        step=step,
        epoch=0,
        position=step * 8,
        path=f"/ck/step_{step}",
        download=0.5,
        load=0.25,
        skip=0.01,
    )


WORKERS = [
    WorkerPlace(node_id="head", pid=10, rank=0),
    WorkerPlace(node_id="n1", pid=11, rank=1),
    WorkerPlace(node_id="n1", pid=12, rank=2),
    WorkerPlace(node_id="n2", pid=13, rank=3),
]


class FakeLedger:
    """The ledger as the killer sees it, driven by the test (``view``: ChaosView's fields)."""

    def __init__(self) -> None:
        self.view: dict[str, Any] = {
            "training_started": None,
            "attempt": None,
            "training": False,
            "workers": [],
            "step": 0,
            "started_at": 0,
        }
        self.recorded: list[Kill] = []
        self.confirmed: list[tuple[float, bool]] = []
        self.skipped: list[ChaosSkip] = []
        self.errors: list[str] = []

    def chaos_view(self) -> ChaosView:
        return ChaosView(**{**self.view, "workers": tuple(self.view["workers"])})

    def record_kill(self, record: Kill) -> None:
        self.recorded.append(record)

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        self.confirmed.append((time_of_kill, confirmed))

    def record_skip(self, record: ChaosSkip) -> None:
        self.skipped.append(record)

    def report_error(self, message: str) -> None:
        self.errors.append(message)


# A hang policy for tests: a 10 s floor, a 300 s ceiling, learned after 3 observations, no
# storage allowance.
HANG_POLICY = HangPolicy(min_timeout=10.0, max_timeout=300.0, warmup=3, io_timeout=0.0)


def beat(section: str, age: float, step: int = 0, **extra: Any) -> Beat:
    """A rank's heartbeat in ``section``, ``age`` seconds after its last progress."""
    return Beat(section, age, step, **extra)
