"""The optimizer (``optimizer._target_``, a torch.optim class as a Hydra partial) and the
learning-rate schedule: a pure function of the step, so a resumed run (any attempt, any world
size) follows the same curve as an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to ``peak`` over ``warmup_steps``, then constant or cosine to 0 at
    ``total_steps``."""

    peak: float
    kind: str = "cosine"
    warmup_steps: int = 0
    total_steps: int = 1

    @classmethod
    def for_trainer(cls, trainer: Any, steps_per_epoch: int) -> LRSchedule:
        """``trainer.lr`` (scaled by global batch / ``lr_reference_batch`` when that is set:
        the linear scaling rule), warmup over ``warmup_steps`` or ``warmup_epochs``."""
        peak = trainer.lr
        if trainer.lr_reference_batch:
            peak *= trainer.global_batch_size / trainer.lr_reference_batch
        warmup = max(trainer.warmup_steps, round(trainer.warmup_epochs * steps_per_epoch))
        return cls(peak, trainer.lr_schedule, warmup, steps_per_epoch * trainer.epochs)

    def __call__(self, step: int) -> float:
        """Learning rate for 0-based ``step``."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(module: Any, decay_norm_and_bias: bool = True) -> list[dict[str, Any]]:
    """The model's parameters; with ``decay_norm_and_bias=False`` biases and normalisation
    weights (every parameter of one dimension) get no weight decay, as ImageNet recipes do."""
    params = [p for p in module.parameters() if p.requires_grad]
    if decay_norm_and_bias:
        return [{"params": params}]
    decay = [p for p in params if p.ndim > 1]
    plain = [p for p in params if p.ndim <= 1]
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def build_optimizer(node: dict[str, Any], params: Iterable[Any], lr: float) -> Any:
    """Instantiate ``optimizer._target_`` with the model's parameters (or parameter groups)
    and ``lr`` (the schedule sets each step's rate)."""
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
