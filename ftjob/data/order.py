"""The data order: deterministic, exact-once, constant-cost to resume.

An epoch's sample order is a pure function of ``(seed, epoch, number of samples)``
(:func:`epoch_order`). Training position is counted in *global samples*: after ``k`` steps of
global batch ``B`` the position is ``k * B``. Resuming slices the order at that position, so
the skipped samples are never read or decoded, and the samples trained are exactly the ones the
previous attempts did not train -- whatever the number of attempts or workers, as long as the
global batch size stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ORDER_STREAM = 0x0DE5  # keeps the order's random stream apart from augmentation streams


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of sample ids in ``epoch``: the same in every attempt and on every worker."""
    return np.random.default_rng([seed, epoch, ORDER_STREAM]).permutation(num_samples)


@dataclass(frozen=True)
class EpochPlan:
    """How one epoch's samples map to steps and ranks (``drop_last``: the tail that does not
    fill a global batch is the same in every attempt and is not trained)."""

    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.global_batch_size > self.num_samples:
            raise ValueError(
                f"global batch size {self.global_batch_size} (trainer.batch_size x trainer.num_workers) "
                f"is larger than the {self.num_samples} training samples: lower trainer.batch_size"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.global_batch_size

    def check_position(self, position: int) -> None:
        if position % self.global_batch_size or not 0 <= position <= self.samples_per_epoch:
            raise ValueError(
                f"position {position} is not a step boundary of global batch {self.global_batch_size} "
                f"in an epoch of {self.samples_per_epoch} samples"
            )

    def shard(self, epoch: int, position: int, rank: int, world_size: int) -> np.ndarray:
        """Ids that ``rank`` trains in ``epoch`` from global sample ``position`` on, in order."""
        if self.global_batch_size % world_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split over {world_size} workers"
            )
        self.check_position(position)
        order = epoch_order(self.num_samples, self.seed, epoch)[position : self.samples_per_epoch]
        per_rank = self.global_batch_size // world_size
        return order.reshape(-1, world_size, per_rank)[:, rank, :].reshape(-1)


def validation_ids(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """Each rank's contiguous share of the validation set; together they cover it once."""
    return np.array_split(np.arange(num_samples), world_size)[rank]
