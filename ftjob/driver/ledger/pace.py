"""Where a run stands on its progress line: the time left (ETA) and the data-wait share.

The ETA is the steps left at the step rate measured between the last two progress points of
the same attempt -- wall clock, so validation, checkpoints and data waits are in it -- or, at
an attempt's first point, the mean time of a step and its batch wait so far. The data-wait share
is the part of the step time spent waiting for the next batch (``train/iter_batch`` against
``train/step``) over the same span: a high one says the input pipeline, not the model, sets the
pace. Where the input path is timed (decoding in the training process or on the device), the
line also says where a step's time went over the span, in milliseconds a step: reading encoded
bytes, copying them to the device, decoding, augmenting -- on the decode pool's threads and the
side stream, beside the step --, the step itself, and the memory tier's snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob import metrics as M
from ftjob.record import Progress


@dataclass(frozen=True)
class PacePoint:
    """A progress point as the pace needs it."""

    attempt: int
    step: int
    time: float | None
    step_s: float  # train/step so far
    wait_s: float  # train/iter_batch so far
    steps: float  # train/steps_completed so far
    stages: dict[str, float] = field(default_factory=dict)  # STAGES' seconds so far


# Where a step's time goes, as the progress line names each part: the metric it is read from.
STAGES = {
    "read": M.DATA_READ,
    "copy": M.DATA_COPY,
    "decode": M.DATA_DECODE,
    "augment": M.DATA_AUGMENT,
    "step": M.TRAIN_STEP,
    "snapshot": M.CHECKPOINT_MEMORY_SNAPSHOT_TIME,
}
INPUT = ("read", "copy", "decode", "augment")


@dataclass(frozen=True)
class Pace:
    eta_s: float | None  # None: no step measured yet
    data_wait: float | None  # share of step time waiting for data, 0..1
    stages: dict[str, float] = field(default_factory=dict)  # ms a step; empty: input untimed

    def text(self) -> str:
        """`` | ETA 1:02:03 | data wait 12% | ms a step: read 0.8, decode 6.1, ...`` (the
        parts known so far)."""
        parts = []
        if self.eta_s is not None:
            parts.append(f"ETA {clock(self.eta_s)}")
        if self.data_wait is not None:
            parts.append(f"data wait {self.data_wait:.0%}")
        if self.stages:
            parts.append("ms a step: " + ", ".join(f"{k} {v:.1f}" for k, v in self.stages.items()))
        return "".join(f" | {part}" for part in parts)


def clock(seconds: float) -> str:
    """``m:ss`` below an hour, ``h:mm:ss`` from one."""
    whole = max(int(round(seconds)), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def pace_point(attempt: int, progress: Progress, metrics: dict[str, float]) -> PacePoint:
    return PacePoint(
        attempt=attempt,
        step=progress.step,
        time=progress.time,
        step_s=float(metrics.get(M.TRAIN_STEP) or 0.0),
        wait_s=float(metrics.get(M.TRAIN_ITER_BATCH) or 0.0),
        steps=float(metrics.get(M.TRAIN_STEPS_COMPLETED) or 0.0),
        stages={name: float(metrics.get(key) or 0.0) for name, key in STAGES.items()},
    )


def pace(previous: PacePoint | None, current: PacePoint, total_steps: int) -> Pace:
    """The pace at ``current``: over the span since ``previous`` when it is an earlier point of
    the same attempt, else over everything ``current``'s metrics hold."""
    left = max(total_steps - current.step, 0)
    same = (
        previous is not None
        and previous.attempt == current.attempt
        and previous.step < current.step
        and previous.time is not None
        and current.time is not None
        and current.time >= previous.time
    )
    stages = dict(current.stages)
    if same and previous is not None and previous.time is not None and current.time is not None:
        per_step: float | None = (current.time - previous.time) / (current.step - previous.step)
        busy = current.step_s - previous.step_s
        waited = current.wait_s - previous.wait_s
        steps = float(current.step - previous.step)
        stages = {k: v - previous.stages.get(k, 0.0) for k, v in stages.items()}
    else:
        busy, waited, steps = current.step_s, current.wait_s, current.steps
        per_step = (busy + waited) / current.steps if current.steps > 0 else None
    total = busy + waited
    share = waited / total if total > 0 and waited >= 0 and busy >= 0 else None
    eta = per_step * left if per_step is not None else None
    return Pace(eta_s=eta, data_wait=share, stages=stage_times(stages, steps))


def stage_times(seconds: dict[str, float], steps: float) -> dict[str, float]:
    """Milliseconds a step of each stage over ``steps``; none where the input path is not
    timed (Ray Data's tasks) or nothing was trained."""
    if steps <= 0 or not any(seconds.get(name, 0.0) > 0 for name in INPUT):
        return {}
    return {name: max(v, 0.0) * 1000.0 / steps for name, v in seconds.items() if v > 0}
