"""When to checkpoint: a fixed step interval, or Young's optimum for the checkpoint cost the run
measures and the failure rate it declares (``trainer.checkpoint_every_n_steps=auto``). The
reporting side (:mod:`ftjob.reporting.goodput`) predicts a run's ETTR with the same model."""

from __future__ import annotations

import math


def optimal_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: the seconds of training between checkpoints that waste
    least, for a checkpoint that stalls training ``cost_s`` and a failure every ``mtbf_s``."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


class CheckpointSchedule:
    """When the next periodic checkpoint is due: every ``every`` steps (0: epoch ends only),
    or with ``every="auto"`` at Young's optimum for the checkpoint cost measured so far and
    ``mtbf_s`` -- a probe checkpoint after ``probe_steps`` steps measures the first cost, and
    every checkpoint refreshes it. Rank 0 decides (:meth:`saved`); the others take its
    decision (:meth:`follow`), so every rank checkpoints at the same steps."""

    def __init__(self, every: int | str, mtbf_s: float | None, probe_steps: int = 10) -> None:
        self.auto = every == "auto"
        self.every = 0 if self.auto else int(every)
        self.mtbf_s = mtbf_s or 0.0
        self.next_step = probe_steps if self.auto else 0
        self.costs: list[float] = []
        self.interval_steps: int | None = None

    def due(self, step: int) -> bool:
        if self.auto:
            return step >= self.next_step
        return bool(self.every) and step % self.every == 0

    def saved(self, step: int, cost_s: float, step_s: float) -> int:
        """Rank 0, after the checkpoint of ``step`` stalled training ``cost_s``; ``step_s``:
        seconds per training step. Returns the step of the next periodic checkpoint."""
        if self.auto:
            self.costs.append(cost_s)
            cost = sum(self.costs[-20:]) / len(self.costs[-20:])
            best_s = optimal_interval_s(cost, self.mtbf_s)
            self.interval_steps = max(1, round(best_s / step_s)) if step_s > 0 else 1
            self.next_step = step + self.interval_steps
        return self.next_step

    def follow(self, next_step: int) -> None:
        self.next_step = next_step

    def describe(self) -> str:
        cost = sum(self.costs[-20:]) / max(1, len(self.costs[-20:]))
        return (
            f"checkpoint interval (auto): every {self.interval_steps} steps, for a checkpoint "
            f"cost of {cost:.2f} s and failure.expected_mtbf_s={self.mtbf_s:g}"
        )
