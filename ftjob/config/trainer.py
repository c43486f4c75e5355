"""``trainer.*``: the training job's shape -- workers and their resources, epochs and batches,
the learning rate and its schedule, precision, data loading, validation and checkpoint cadence,
and an elastic group's bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftjob.config.choices import Choice, coerce_choices
from ftjob.config.rules import at_least, require

# Exact mode's micro-batches a global batch is cut into when trainer.micro_batch_size is null:
# enough for the ranks of an 8-GPU node (1, 2, 4 or 8 ranks split them evenly), a power of two
# (the float32 tree's sum) where the global batch allows it.
EXACT_MICRO_BATCHES = 8


def exact_micro_batch(global_batch: int) -> int:
    """Exact mode's micro-batch for ``trainer.micro_batch_size=null``: a function of the global
    batch alone -- the global batch in the fewest micro-batches from
    :data:`EXACT_MICRO_BATCHES` up that divide it (all of it, one sample each, where none
    does) -- so the same job trains the same arithmetic at every world size that splits them."""
    count = next(
        (c for c in range(EXACT_MICRO_BATCHES, global_batch + 1) if global_batch % c == 0),
        global_batch,
    )
    return global_batch // count


class LrSchedule(Choice):
    """``trainer.lr_schedule``: the learning rate after warm-up."""

    constant = "constant"
    cosine = "cosine"  # cosine decay to 0 over the run's steps


class Precision(Choice):
    """``trainer.precision``: the forward pass's arithmetic."""

    fp32 = "fp32"
    bf16 = "bf16"  # bf16 autocast


class DecodePlace(Choice):
    """``trainer.decode_in``: where training and validation batches are decoded."""

    # auto: CPU training -- the worker where its workers hold a machine's cores, else ray;
    # GPU training -- the fastest of device, worker and ray (where the cluster has cores
    # beside the workers') measured on the first batch, kept for the whole run.
    # worker: in the training process, a thread ahead of the step (GPU training: a pool of the
    # worker's reserved CPUs but one), with PIL. device: the CPUs read encoded bytes, the
    # training device decodes (nvJPEG on a GPU) and augments each batch while the step
    # before it trains (ftjob.data.device_decode).
    auto = "auto"
    worker = "worker"
    ray = "ray"  # Ray Data tasks
    device = "device"


class Placement(Choice):
    """``trainer.placement``: Ray's placement strategy for the workers (null: SPREAD on a
    simulated cluster, else PACK)."""

    PACK = "PACK"
    SPREAD = "SPREAD"


@dataclass
class TrainerConfig:
    _group: ClassVar[str] = "trainer"
    num_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    epochs: int = 3
    batch_size: int = 32
    # Samples per forward/backward pass; null: batch_size (exact mode: exact_micro_batch).
    micro_batch_size: int | None = None
    val_batch_size: int | None = None
    lr: float = 1e-3
    lr_schedule: LrSchedule = LrSchedule.cosine
    warmup_steps: int = 0
    warmup_epochs: float = 0.0
    lr_reference_batch: int | None = None
    label_smoothing: float = 0.0
    weight_decay_norm_and_bias: bool = True
    validate_every_n_steps: int = 0
    # Steps, or "auto". OmegaConf 2.3 types no union of int and a word, so this key is checked
    # here.
    checkpoint_every_n_steps: Any = 0
    log_every_n_steps: int = 10
    seed: int = 0
    audit_samples: bool = False
    stop_on_nonfinite_loss: bool = True
    prefetch_batches: int = 2
    validation_cache_mb: int = 512
    decode_cpus: float = 1.0
    decode_window_mb: float = 256
    decode_in: DecodePlace = DecodePlace.auto
    precision: Precision = Precision.fp32
    channels_last: bool = False
    placement: Placement | None = None
    min_workers: int | None = None  # elastic: train on as few as this; num_workers is the most
    resize_interval: float = 60.0  # elastic: how often a running group checks for capacity
    exact: bool = False  # the same weights, bit for bit, at any world size (ftjob.worker.exact)

    def __post_init__(self) -> None:
        coerce_choices(self)
        self._check_shape()
        self._check_cadence()
        self._check_optimisation()
        self._check_data_loading()
        self._check_resources()
        self._check_elastic()
        self._check_exact()

    def _check_shape(self) -> None:
        at_least(self, "num_workers", 1)
        at_least(self, "epochs", 1)
        at_least(self, "batch_size", 1, " (per worker)")
        require(
            self.val_batch_size is None or self.val_batch_size >= 1,
            self._group,
            "val_batch_size",
            self.val_batch_size,
            "must be >= 1, or null for batch_size",
        )

    def _check_cadence(self) -> None:
        at_least(self, "validate_every_n_steps", 0, " (0 = at the end of each epoch only)")
        at_least(self, "log_every_n_steps", 1)
        every = self.checkpoint_every_n_steps
        require(
            every == "auto" or (type(every) is int and every >= 0),
            self._group,
            "checkpoint_every_n_steps",
            every,
            "must be a number of steps >= 0 (0 = at the end of each epoch only), or auto (the "
            "interval that wastes least for the measured checkpoint cost and "
            "failure.expected_mtbf_s)",
        )

    def _check_optimisation(self) -> None:
        g = self._group
        require(
            self.lr > 0 and math.isfinite(self.lr), g, "lr", self.lr, "must be a finite number > 0"
        )
        at_least(self, "warmup_steps", 0)
        at_least(self, "warmup_epochs", 0)
        require(
            self.lr_reference_batch is None or self.lr_reference_batch >= 1,
            g,
            "lr_reference_batch",
            self.lr_reference_batch,
            "must be >= 1 (the global batch trainer.lr is meant for, e.g. 256), or null",
        )
        require(
            0 <= self.label_smoothing < 1,
            g,
            "label_smoothing",
            self.label_smoothing,
            "must be in [0, 1)",
        )

    def _check_data_loading(self) -> None:
        g = self._group
        at_least(self, "prefetch_batches", 0)
        at_least(
            self,
            "validation_cache_mb",
            0,
            " (0 = read and decode the validation set at every validation)",
        )
        require(self.decode_cpus > 0, g, "decode_cpus", self.decode_cpus, "must be > 0")
        require(
            self.decode_window_mb > 0,
            g,
            "decode_window_mb",
            self.decode_window_mb,
            "must be > 0 (decoded data per worker held ahead of training, in MB)",
        )

    def _check_resources(self) -> None:
        g = self._group
        gpus = self.resources_per_worker.get("GPU", 0)
        require(
            self.use_gpu or not gpus,
            g,
            "resources_per_worker",
            self.resources_per_worker,
            f"asks for {gpus:g} GPU per worker while trainer.use_gpu=false: set trainer.use_gpu=true, "
            "or drop the GPU with '~trainer.resources_per_worker.GPU'",
        )
        negative = {k: v for k, v in self.resources_per_worker.items() if v < 0}
        require(
            not negative,
            g,
            "resources_per_worker",
            self.resources_per_worker,
            "amounts must be >= 0",
        )

    def _check_elastic(self) -> None:
        """Every world size the group may run at must split the global batch evenly: each
        rank trains the same share of every global batch, so the averaged gradient is the
        global batch's."""
        g = self._group
        low = self.min_workers
        require(
            low is None or 1 <= low <= self.num_workers,
            g,
            "min_workers",
            low,
            f"must be between 1 and trainer.num_workers={self.num_workers} (the most workers), or "
            "null for a fixed-size group",
        )
        require(
            self.resize_interval > 0,
            g,
            "resize_interval",
            self.resize_interval,
            "must be > 0 seconds",
        )
        if low is None:
            return
        uneven = [w for w in range(low, self.num_workers + 1) if self.global_batch_size % w]
        require(
            not uneven,
            g,
            "min_workers",
            low,
            f"the global batch {self.global_batch_size} (trainer.batch_size x trainer.num_workers) "
            f"does not split evenly over {uneven[0] if uneven else 0} workers: raise "
            "trainer.min_workers, or choose a batch_size that every world size from min_workers "
            "to num_workers divides",
        )

    def _check_exact(self) -> None:
        """``micro_batch_size`` >= 1; in exact mode, every world size the group may run at
        must cut each rank's share of the global batch into whole micro-batches of it."""
        micro = self.micro_batch_size
        require(
            micro is None or micro >= 1,
            self._group,
            "micro_batch_size",
            micro,
            "must be >= 1, or null for trainer.batch_size (exact mode: the global batch in "
            f"{EXACT_MICRO_BATCHES} or more micro-batches)",
        )
        if not self.exact:
            return
        size, worlds = (
            self.micro_batch,
            range(self.min_workers or self.num_workers, self.num_workers + 1),
        )
        shares = [self.global_batch_size // w for w in worlds if self.global_batch_size % w == 0]
        uneven = [
            w for w in worlds if self.global_batch_size % w or (self.global_batch_size // w) % size
        ]
        fits = math.gcd(*shares) if shares else 1
        require(
            not uneven,
            self._group,
            "micro_batch_size",
            micro if micro is not None else f"null (exact mode's default for it: {size})",
            f"trainer.exact=true cuts the global batch {self.global_batch_size} (trainer.batch_size x "
            f"trainer.num_workers) into micro-batches of {size} samples, each rank a whole number "
            f"of them, at every world size from trainer.min_workers to trainer.num_workers: on "
            f"{uneven[0] if uneven else 0} workers a rank's share is not: set "
            f"trainer.micro_batch_size to a divisor of {fits}",
        )

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward pass: ``micro_batch_size``, else ``batch_size`` -- in
        exact mode :func:`exact_micro_batch` of the global batch, which no world size changes
        (a rank's ``batch_size`` does: the same job at 1 x 64 and 2 x 32 would otherwise cut
        its batches, and so its arithmetic, differently)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return exact_micro_batch(self.global_batch_size) if self.exact else self.batch_size

    @property
    def exact_note(self) -> str | None:
        """What exact mode says before training: its micro-batches and the sum they take
        (:mod:`ftjob.worker.exact_sum`: a float32 tree where their count is a power of two)."""
        if not self.exact:
            return None
        micro = self.micro_batch
        count = self.global_batch_size // micro
        split = (
            f"exact mode: the global batch {self.global_batch_size} in {count} micro-batches "
            f"of {micro}"
        )
        if self.micro_batch_size is None:
            split += f" (trainer.micro_batch_size=null: the fewest from {EXACT_MICRO_BATCHES} up)"
        if count & (count - 1) == 0:
            return f"{split}, their gradients summed in float32 in one fixed tree"
        return (
            f"{split}, not a power of two: their gradients summed as integers on a grid, "
            "float64 on the wire (a power-of-two count is summed in a float32 tree, half the bytes)"
        )

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_workers

    @property
    def worker_cpus(self) -> float:
        return float(self.resources_per_worker.get("CPU", 1.0))
