"""Metric keys, a Timer, and the metric set that rides in every checkpoint.

Every key in :data:`METRIC_KEYS` is always present (0 when unused) and JSON-safe, so summary
files from different runs always line up column for column. A non-finite value (a diverged
loss) is written as ``null``, never as a number: 0 would read as a perfect loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Timers: total seconds spent.
TRAIN_STEP = "train/step"  # seconds in training steps, not a count (that is train/steps_completed)
TRAIN_ITER_BATCH = "train/iter_batch"
TRAIN_ITER_FIRST_BATCH = "train/iter_first_batch"
TRAIN_ITER_SKIP_BATCH = "train/iter_skip_batch"
VALIDATION_STEP = "validation/step"
CHECKPOINT_SAVE = "checkpoint/save"
CHECKPOINT_UPLOAD = "checkpoint/upload"
CHECKPOINT_REPORT = "checkpoint/report"
CHECKPOINT_DOWNLOAD = "checkpoint/download"
CHECKPOINT_LOAD = "checkpoint/load"
CHECKPOINT_RESTORATION_TIME = "checkpoint/restoration_time"
CHECKPOINT_RETRY_WAIT = "checkpoint/retry_wait_s"
# What the training thread lost to memory snapshots: its part in taking them and its wait before
# the optimizer's step (the device's included), and that wait alone.
CHECKPOINT_MEMORY_SNAPSHOT_TIME = "checkpoint/memory_snapshot_time"
CHECKPOINT_MEMORY_SNAPSHOT_WAIT = "checkpoint/memory_snapshot_wait"
# Where the input's time went (seconds, rank 0; threads and streams beside the step's): encoded
# bytes read and their headers, pinned and copied to the device, decoded, cropped and resized.
DATA_READ = "data/read"
DATA_COPY = "data/copy"
DATA_DECODE = "data/decode"
DATA_AUGMENT = "data/augment"
# Rates, counts and last values.
TRAIN_GLOBAL_THROUGHPUT = "train/global_throughput"
TRAIN_ROWS_PROCESSED = "train/rows_processed"
TRAIN_STEPS_COMPLETED = "train/steps_completed"
TRAIN_LOSS = "train/loss"
VALIDATION_LOSS = "validation/loss"
VALIDATION_ACCURACY = "validation/accuracy"
CHECKPOINT_UPLOAD_ATTEMPTS = "checkpoint/upload_attempts"
CHECKPOINT_UPLOAD_RETRIES = "checkpoint/upload_retries"
CHECKPOINT_UPLOAD_FAILURES = "checkpoint/upload_failures"
CHECKPOINT_MEMORY_SNAPSHOTS = "checkpoint/memory_snapshots"  # held by the memory tier
CHECKPOINT_MEMORY_RESTORES = "checkpoint/memory_restores"  # restores from the memory tier
CHAOS_KILLS = "chaos/kills"
FAILURES_COUNT = "failures/count"
RECOVERY_TIME_TO_RECOVER = "recovery/time_to_recover"
RECOVERY_LOST_STEPS = "recovery/lost_steps"
PREEMPTION_COUNT = "preemption/count"
PREEMPTION_LOST_STEPS = "preemption/lost_steps"
PREEMPTION_JIT_CHECKPOINT_TIME = "preemption/jit_checkpoint_time"
GOODPUT_ETTR = "goodput/ettr"  # share of the wall clock in training steps that count
GOODPUT_PREDICTED_ETTR = "goodput/predicted_ettr"  # the first-order model's (0: no checkpoint)
CHECKPOINT_OPTIMAL_INTERVAL = "checkpoint/optimal_interval_s"  # the model's (0: no failure rate)
HANG_COUNT = "hang/count"
HANG_DETECTION_TIME = "hang/detection_time"  # mean seconds from a stall to its detection
STRAGGLER_MAX_SLOWDOWN = "straggler/max_slowdown"  # the slowest rank's step time / the fastest's
ELASTIC_RESIZES = "elastic/resizes"  # changes of world size between attempts
ELASTIC_TIME_BELOW_FULL = "elastic/time_below_full_s"  # seconds trained on fewer than num_workers
# The input path (rank 0): images decoded in the device's batches, and those decoded on the CPU
# instead, by reason (ftjob.data.headers.FALLBACKS); where batches are decoded
# (trainer.decode_in: DECODE_PLACES' codes) and auto's probe of each place (images/s, 0: not
# measured).
DATA_DEVICE_DECODED = "data/device_decoded"
FALLBACK_REASONS = ("format", "progressive", "cmyk", "layout", "truncated", "refused")
DATA_FALLBACK = "data/fallback_"  # + reason
DATA_FALLBACKS = tuple(DATA_FALLBACK + reason for reason in FALLBACK_REASONS)
DATA_DECODE_PLACE = "data/decode_place"
DECODE_PLACES = {"worker": 1, "ray": 2, "device": 3}  # data/decode_place's codes (0: not chosen)
DATA_PROBE = "data/probe_"  # + place: auto's measured images/s
DATA_PROBES = tuple(DATA_PROBE + place for place in DECODE_PLACES)
# The memory tensors held on rank 0's GPU (MiB, torch's allocated bytes; 0 on a CPU): the peak
# of the last epoch that ended, the highest of any epoch, and the largest rise of an epoch's
# peak over the epoch before it -- 0 while the run's memory is flat.
GPU_MEMORY_EPOCH_PEAK = "gpu/memory_epoch_peak_mb"
GPU_MEMORY_PEAK = "gpu/memory_peak_mb"
GPU_MEMORY_GROWTH = "gpu/memory_growth_mb"

METRIC_KEYS: tuple[str, ...] = (
    TRAIN_STEP,
    TRAIN_ITER_BATCH,
    TRAIN_ITER_FIRST_BATCH,
    TRAIN_ITER_SKIP_BATCH,
    TRAIN_GLOBAL_THROUGHPUT,
    TRAIN_ROWS_PROCESSED,
    TRAIN_STEPS_COMPLETED,
    TRAIN_LOSS,
    VALIDATION_STEP,
    VALIDATION_LOSS,
    VALIDATION_ACCURACY,
    CHECKPOINT_SAVE,
    CHECKPOINT_UPLOAD,
    CHECKPOINT_REPORT,
    CHECKPOINT_DOWNLOAD,
    CHECKPOINT_LOAD,
    CHECKPOINT_RESTORATION_TIME,
    CHECKPOINT_UPLOAD_ATTEMPTS,
    CHECKPOINT_UPLOAD_RETRIES,
    CHECKPOINT_UPLOAD_FAILURES,
    CHECKPOINT_RETRY_WAIT,
    CHECKPOINT_MEMORY_SNAPSHOTS,
    CHECKPOINT_MEMORY_SNAPSHOT_TIME,
    CHECKPOINT_MEMORY_SNAPSHOT_WAIT,
    CHECKPOINT_MEMORY_RESTORES,
    CHAOS_KILLS,
    FAILURES_COUNT,
    RECOVERY_TIME_TO_RECOVER,
    RECOVERY_LOST_STEPS,
    PREEMPTION_COUNT,
    PREEMPTION_LOST_STEPS,
    PREEMPTION_JIT_CHECKPOINT_TIME,
    GOODPUT_ETTR,
    GOODPUT_PREDICTED_ETTR,
    CHECKPOINT_OPTIMAL_INTERVAL,
    HANG_COUNT,
    HANG_DETECTION_TIME,
    STRAGGLER_MAX_SLOWDOWN,
    ELASTIC_RESIZES,
    ELASTIC_TIME_BELOW_FULL,
    DATA_READ,
    DATA_COPY,
    DATA_DECODE,
    DATA_AUGMENT,
    DATA_DEVICE_DECODED,
    *DATA_FALLBACKS,
    DATA_DECODE_PLACE,
    *DATA_PROBES,
    GPU_MEMORY_EPOCH_PEAK,
    GPU_MEMORY_PEAK,
    GPU_MEMORY_GROWTH,
)


def json_safe(value: Any) -> Any:
    """Numbers as finite floats/ints, inf and NaN as None (JSON ``null``), recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item"):  # numpy / torch scalars
        return json_safe(value.item())
    return value


def finite(value: Any, default: float = 0.0) -> float:
    """``value`` as a float for arithmetic; ``default`` for None (a value written as null)."""
    if value is None:
        return default
    number = float(value)
    return number if math.isfinite(number) else default


def fmt(value: Any, spec: str = ".4f") -> str:
    """A number for a progress line or a table; ``null`` for a non-finite or missing one."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "null"
    return format(value, spec)


class MetricSet:
    """Named float accumulators. Timers add elapsed seconds; gauges are set."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self._values: dict[str, float] = dict.fromkeys(METRIC_KEYS, 0.0)

    def add(self, key: str, amount: float) -> None:
        self._values[key] = self._values.get(key, 0.0) + float(amount)

    def set(self, key: str, value: float) -> None:
        self._values[key] = float(value)

    def seconds_per_step(self) -> float:
        """Training step and batch wait per step so far (0.0 before the first step)."""
        steps = self._values.get(TRAIN_STEPS_COMPLETED, 0.0)
        busy = self._values.get(TRAIN_STEP, 0.0) + self._values.get(TRAIN_ITER_BATCH, 0.0)
        return busy / steps if steps else 0.0

    def get(self, key: str) -> float:
        return self._values.get(key, 0.0)

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        """Add the time spent in the block to ``key``, also when the block raises."""
        start = self._clock()
        try:
            yield
        finally:
            self.add(key, self._clock() - start)

    def as_dict(self) -> dict[str, float]:
        return json_safe(dict(self._values))

    def state_dict(self) -> dict[str, float]:
        return dict(self._values)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._values = dict.fromkeys(METRIC_KEYS, 0.0)
        self._values.update({k: float(v) for k, v in state.items()})
