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


def fixed_micro_batches(rank_batch: int, micro_batch: int) -> int:
    """How many micro-batches of exactly ``micro_batch`` samples a rank's slice of
    ``rank_batch`` holds (``trainer.exact``: every micro-batch the same size at any world
    size, so that none is cut differently on another)."""
    if micro_batch < 1 or rank_batch < micro_batch or rank_batch % micro_batch:
        raise ValueError(
            f"trainer.exact=true: this rank's {rank_batch} samples of the global batch are not a "
            f"whole number of micro-batches of trainer.micro_batch_size={micro_batch} at this "
            "world size: choose a trainer.micro_batch_size that divides the global batch "
            "(trainer.batch_size x trainer.num_workers) divided by every world size the run "
            "takes"
        )
    return rank_batch // micro_batch
