"""The optimizer (``optimizer._target_``, a torch.optim class as a Hydra partial) and the
learning-rate schedule: a pure function of the step, so a resumed run (any attempt, any world
size) follows the same curve as an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to ``peak`` over ``warmup_steps``, then constant or cosine to 0 at
    ``total_steps``."""

    peak: float
    kind: str = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1

    def __call__(self, step: int) -> float:
        """Learning rate for 0-based ``step``."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(node: dict[str, Any], params: Iterable[Any], lr: float) -> Any:
    """Instantiate ``optimizer._target_`` with the model's parameters and ``lr`` (the schedule
    sets each step's rate)."""
    import torch
    from hydra.utils import instantiate

    factory = instantiate({**node, "_partial_": True}, _convert_="all")
    optimizer = factory(params, lr=lr)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer._target_={node.get('_target_')!r} built a {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer
