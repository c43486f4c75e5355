"""The data order: deterministic, exact-once, constant-cost to resume.

An epoch's sample order is a pure function of ``(seed, epoch, number of samples)``
(:func:`epoch_order`), and, for data stored in row groups (Parquet), of the groups and the
shuffle window (:class:`ShuffleWindows`): the groups in a random order, the samples shuffled
within windows of consecutive groups of it, so a decode reads each group once per window. Training position is counted in *global samples*: after ``k`` steps of
global batch ``B`` the position is ``k * B``. Resuming slices the order at that position, so
the skipped samples are never read or decoded, and the samples trained are exactly the ones the
previous attempts did not train -- whatever the number of attempts or workers, as long as the
global batch size stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ORDER_STREAM = 0x0DE5  # keeps the order's random stream apart from augmentation streams


@dataclass(frozen=True)
class ShuffleWindows:
    """Sample ids stored in row groups, and how many samples are shuffled together.

    The groups hold consecutive ids, in id order: ``sizes[i]`` rows, ``counts[i]`` groups in
    a row (run lengths: a split of equal row groups is a few numbers). An epoch takes the groups
    in a random order and cuts it into windows of whole, consecutive groups of at least
    ``window`` samples (the last window: what is left); the samples of a window are shuffled
    together. A window holds about ``window`` samples' bytes in a decoder, each of its groups
    read once."""

    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    window: int

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.counts) or min(self.sizes + self.counts, default=1) < 1:
            raise ValueError(f"row groups {self.sizes} x {self.counts}: runs of positive sizes")
        if self.window < 1:
            raise ValueError(f"shuffle window {self.window}: must be >= 1 sample")

    @classmethod
    def of_groups(cls, group_rows: np.ndarray, window: int) -> ShuffleWindows:
        """From every group's row count, in id order."""
        rows = np.asarray(group_rows, dtype=np.int64)
        if len(rows) == 0:
            return cls((), (), window)
        change = np.flatnonzero(np.diff(rows)) + 1
        starts = np.concatenate([[0], change])
        counts = np.diff(np.concatenate([starts, [len(rows)]]))
        return cls(tuple(int(r) for r in rows[starts]), tuple(int(c) for c in counts), window)

    @property
    def num_samples(self) -> int:
        return sum(s * c for s, c in zip(self.sizes, self.counts, strict=True))

    def group_rows(self) -> np.ndarray:
        return np.repeat(np.asarray(self.sizes, dtype=np.int64), self.counts)

    def order(self, rng: np.random.Generator) -> np.ndarray:
        """One epoch's order: groups permuted, samples shuffled within each window."""
        ids, window = self._grouped(rng)
        # Windows are runs of ``ids``: each shuffled in place, one permutation a window.
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(window)) + 1, [len(ids)]])
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            ids[start:end] = ids[start:end][rng.permutation(end - start)]
        return ids

    def _grouped(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Every id in the order of a random permutation of the groups, and its window."""
        rows = self.group_rows()
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        groups = rng.permutation(len(rows))
        lengths = rows[groups]
        ends = np.cumsum(lengths)
        # A window closes at the group that brings its samples to ``window`` or more.
        window_of_group = np.zeros(len(groups), dtype=np.int64)
        k, filled = 0, 0
        for g, n in enumerate(lengths.tolist()):  # one pass over the groups, not the samples
            window_of_group[g] = k
            filled += n
            if filled >= self.window:
                k, filled = k + 1, 0
        first = np.repeat(starts[groups] - (ends - lengths), lengths)
        ids = first + np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        return ids, np.repeat(window_of_group, lengths)

    def window_index(self, seed: int, epoch: int) -> np.ndarray:
        """The window of every sample id in ``epoch`` (indexed by id)."""
        ids, window = self._grouped(np.random.default_rng([seed, epoch, ORDER_STREAM]))
        out = np.empty(len(ids), dtype=np.int64)
        out[ids] = window
        return out


def epoch_order(
    num_samples: int, seed: int, epoch: int, windows: ShuffleWindows | None = None
) -> np.ndarray:
    """The order of sample ids in ``epoch``: the same in every attempt and on every worker. A
    permutation of all samples, or, with ``windows``, one shuffled window of row groups after
    another."""
    rng = np.random.default_rng([seed, epoch, ORDER_STREAM])
    if windows is None:
        return rng.permutation(num_samples)
    if windows.num_samples != num_samples:
        raise ValueError(
            f"row groups of {windows.num_samples} samples for a split of {num_samples}"
        )
    return windows.order(rng)


@dataclass(frozen=True)
class EpochPlan:
    """How one epoch's samples map to steps and ranks (``drop_last``: the tail that does not
    fill a global batch is the same in every attempt and is not trained)."""

    num_samples: int
    global_batch_size: int
    seed: int
    windows: ShuffleWindows | None = None  # row-grouped data: shuffled in windows of groups

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

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's order of sample ids (:func:`epoch_order`)."""
        return epoch_order(self.num_samples, self.seed, epoch, self.windows)

    def shard(self, epoch: int, position: int, rank: int, world_size: int) -> np.ndarray:
        """Ids that ``rank`` trains in ``epoch`` from global sample ``position`` on, in order."""
        if self.global_batch_size % world_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split over {world_size} workers"
            )
        self.check_position(position)
        order = self.order(epoch)[position : self.samples_per_epoch]
        per_rank = self.global_batch_size // world_size
        return order.reshape(-1, world_size, per_rank)[:, rank, :].reshape(-1)


def validation_ids(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """Each rank's contiguous share of the validation set; together they cover it once."""
    return np.array_split(np.arange(num_samples), world_size)[rank]
