"""Elastic training's batch arithmetic: a rank's share of the unchanged global batch, in
micro-batches of at most ``trainer.batch_size`` (gradients accumulated, each micro-batch's loss
weighted by its share, so the all-reduced gradient is the global batch's mean at any world
size)."""

from __future__ import annotations


def micro_batches(rank_batch: int, batch_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each micro-batch of a rank's ``rank_batch`` samples: as many full
    ``batch_size`` ones as fit, then the rest."""
    if rank_batch < 1 or batch_size < 1:
        raise ValueError(f"rank batch {rank_batch} and micro-batch {batch_size} must be >= 1")
    return [(i, min(i + batch_size, rank_batch)) for i in range(0, rank_batch, batch_size)]
