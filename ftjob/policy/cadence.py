"""When to checkpoint: a fixed step interval, or Young's optimum for the checkpoint cost the run
measures and the failure rate it declares (``trainer.checkpoint_every_n_steps=auto``); when to
take a memory snapshot, at a fixed interval or the shortest one within a share of step time
(``checkpoint.memory.every_n_steps=auto``). The reporting side (:mod:`ftjob.reporting.goodput`)
predicts a run's ETTR with the same model as the checkpoint interval's."""

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


def snapshot_interval(cost_s: float, step_s: float, max_overhead: float) -> int:
    """The shortest interval, in steps, at which a snapshot that costs ``cost_s`` costs at
    most ``max_overhead`` of the ``step_s`` each step takes: ``cost / (interval * step) <=
    max_overhead``. 1 when a step's time is not known yet."""
    if step_s <= 0:
        return 1
    # the tolerance keeps a cost of exactly the budget at its interval (float division)
    return max(1, math.ceil(max(cost_s, 0.0) / (max_overhead * step_s) - 1e-9))


class SnapshotCadence:
    """When the memory tier's next snapshot is due (``checkpoint.memory.every_n_steps``): every
    ``every`` steps, or with ``every="auto"`` at :func:`snapshot_interval` for the cost measured
    so far -- a probe snapshot ``probe_steps`` into the attempt measures the first cost (by then
    a step's time is known; a probe that also set up the tier's memory is taken again,
    :meth:`again`), every snapshot refreshes it (the mean of the last 20). A snapshot's cost is
    known only when its background work ends (:meth:`measured`); until then none is due. One
    rank takes snapshots, so nothing is agreed between ranks."""

    def __init__(self, every: int | str, max_overhead: float, probe_steps: int = 5) -> None:
        self.auto = every == "auto"
        self.every = 1 if self.auto else int(every)
        self.max_overhead, self.probe_steps = max_overhead, probe_steps
        self.next_step: float | None = None  # auto: set at the attempt's first step
        self.last_taken = 0
        self.costs: list[float] = []
        self.interval_steps: int | None = None
        self.step_s = 0.0

    def due(self, step: int) -> bool:
        if not self.auto:
            return step % self.every == 0
        if self.next_step is None:
            self.next_step = step + self.probe_steps - 1  # after probe_steps steps of it
        return step >= self.next_step

    def taken(self, step: int) -> None:
        """A snapshot of ``step`` was taken: with ``auto``, the next waits for its cost."""
        self.last_taken = step
        if self.auto:
            self.next_step = math.inf

    def again(self) -> None:
        """The last snapshot's cost says nothing of the next ones' (it opened the holder's
        memory and page-locked it: once an attempt): with ``auto`` the next step probes
        again, and that cost is kept."""
        if self.auto:
            self.next_step = self.last_taken + 1

    def measured(self, cost_s: float, step_s: float) -> bool:
        """The last snapshot cost ``cost_s`` (what it took from the training thread, and on
        the CPU its background work's CPU); a step takes ``step_s``. Plans the next one; True
        when this is the first interval chosen (said once)."""
        if not self.auto:
            return False
        self.costs.append(cost_s)
        self.step_s = step_s
        first = self.interval_steps is None
        self.interval_steps = snapshot_interval(self.cost_s, step_s, self.max_overhead)
        self.next_step = self.last_taken + self.interval_steps
        return first

    @property
    def cost_s(self) -> float:
        recent = self.costs[-20:]
        return sum(recent) / max(1, len(recent))

    def describe(self) -> str:
        return (
            f"memory snapshot interval (auto): every {self.interval_steps} steps, for a snapshot "
            f"cost of {1e3 * self.cost_s:.1f} ms and {1e3 * self.step_s:.1f} ms a step "
            f"(checkpoint.memory.max_overhead={self.max_overhead:g})"
        )
