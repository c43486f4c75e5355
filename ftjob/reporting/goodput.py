"""Goodput: where every second of a run's wall clock went.

ETTR (effective training time ratio) is the share of the wall clock spent in training steps
that count -- steps re-done after a restore do not. The rest is badput, split by cause from
what the run already measures: the surviving timers of rank 0 (a checkpoint carries them, so
an attempt's lost work is not in them), the recovery records of every failure, and the run's
start and end. ``other`` is what none of them explains (Ray Train's bookkeeping between
steps, validation and checkpoints of lost work); the buckets sum to the wall clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ftjob import metrics as M
from ftjob.metrics import finite
from ftjob.policy.cadence import optimal_interval_s
from ftjob.reporting.run_summary import (
    Buckets,
    FailureRecord,
    Goodput,
    Prediction,
    Recovery,
    ResizeRecord,
)

BUCKETS = tuple(f.name for f in dataclasses.fields(Buckets))  # in order; see Buckets

# Training waiting for a checkpoint: save, upload, report; the memory tier's copies.
CHECKPOINT_TIMERS = (
    M.CHECKPOINT_SAVE,
    M.CHECKPOINT_UPLOAD,
    M.CHECKPOINT_REPORT,
    M.CHECKPOINT_MEMORY_SNAPSHOT_TIME,
)


def _recoveries(failures: Iterable[FailureRecord]) -> list[Recovery]:
    """The recoveries of the failures a new attempt trained after."""
    return [f.recovery for f in failures if f.recovered and f.recovery is not None]


def _planned_resizes(resizes: Iterable[ResizeRecord]) -> float:
    """Seconds of planned elastic resizes, their checkpoint to the resized group's first step
    (whose batch wait and step are in data_wait and training)."""
    return sum(
        max(0.0, finite(r.time_to_recover_s) - r.first_step_s)
        for r in resizes
        if r.cause == "planned"
    )


def _notice_waits(failures: Iterable[FailureRecord]) -> float:
    """Seconds from each preemption notice to its deadline, while the workers wait to be torn
    down; the just-in-time checkpoint in that window is in "checkpoint" already."""
    total = 0.0
    for f in failures:
        notice = f.preemption.notice if f.preemption is not None else None
        if notice is None or not notice.deadline:
            continue
        jit = f.preemption.jit if f.preemption is not None else None
        seconds = finite(jit.seconds) if jit is not None else 0.0
        total += max(0.0, finite(notice.deadline) - notice.received - seconds)
    return total


def _restore(r: Recovery) -> float:
    return finite(r.download_s) + finite(r.load_s) + finite(r.skip_s)


def _recovery(failures: Iterable[FailureRecord]) -> float:
    """Seconds the recovery buckets (detection, restart, restore, setup) hold of these
    failures: origin to the next first step, less that step (in data_wait and training)."""
    total = 0.0
    for f in failures:
        r = f.recovery
        if r is None and f.recovered:
            continue  # a restart that failed: its time is in the recovery of the one before
        parts = finite(f.detection_s)
        parts += finite(r.restart_s) + _restore(r) if r is not None else 0.0
        if r is None or not f.recovered or r.time_to_recover_s is None:
            total += parts
        else:
            total += max(parts, finite(r.time_to_recover_s) - finite(r.first_step_s))
    return total


def _redone(failure: FailureRecord, per_step: float) -> float:
    """The steps a failure lost, at the run's time per step -- at most the wall clock the
    failed attempt spent past the state it went back to (``lost_window_s``): steps trained
    after the failure's origin are in its detection time already."""
    lost = failure.lost_steps * per_step
    window = failure.recovery.lost_window_s if failure.recovery is not None else None
    return lost if window is None else min(lost, finite(window))


def _count_once(buckets: dict[str, float], wall_s: float) -> None:
    """Buckets that overlap give the overlap back, so that none is negative and all sum to the
    wall clock. What can overlap: steps a dying attempt trained after its failure's origin
    that a memory snapshot kept -- the restore brings their timers back, so they are training,
    and they lie in detection's window (origin to noticed) too. They count once, as training:
    the overlap comes out of detection first, then out of setup."""
    overlap = sum(buckets.values()) - wall_s
    for name in ("detection", "setup"):
        if overlap <= 0:
            return
        taken = min(overlap, buckets[name])
        buckets[name] -= taken
        overlap -= taken


def goodput(
    *,
    wall_s: float,
    run_started: float,
    first_step: float | None,
    finished: float | None,
    first_step_took: float = 0.0,
    metrics: Mapping[str, float | None],
    failures: tuple[FailureRecord, ...],
    resizes: tuple[ResizeRecord, ...] = (),
) -> Goodput:
    """Where the wall clock went: its buckets sum to ``wall_s``."""
    steps = finite(metrics.get(M.TRAIN_STEPS_COMPLETED))
    busy = finite(metrics.get(M.TRAIN_STEP))
    waiting = finite(metrics.get(M.TRAIN_ITER_BATCH)) + finite(
        metrics.get(M.TRAIN_ITER_FIRST_BATCH)
    )
    per_step = (busy + waiting) / steps if steps else 0.0
    end = run_started + wall_s
    recovered = _recoveries(failures)
    restore = sum(_restore(r) for r in recovered)
    detection = sum(finite(f.detection_s) for f in failures)
    restart = sum(finite(r.restart_s) for r in recovered)
    # The first step after a restore is in time-to-recover, and also in data_wait and training.
    known_recovery = detection + restart + restore + sum(finite(r.first_step_s) for r in recovered)
    # The first step's own batch wait and step are in data_wait and training; a run that
    # never trained started up until it finished (then shut down) or ended.
    started_up = first_step - first_step_took if first_step else finished or end
    # Failures before the run's first step (an attempt that died starting) recover inside the
    # start-up window: their own buckets hold that time.
    early = [f for f in failures if f.time is not None and f.time < (first_step or end)]
    buckets = {
        "startup": max(0.0, started_up - run_started - _recovery(early)),
        "training": busy,
        "data_wait": waiting,
        "validation": finite(metrics.get(M.VALIDATION_STEP)),
        "checkpoint": sum(finite(metrics.get(k)) for k in CHECKPOINT_TIMERS),
        "detection": detection,
        "restart": restart,
        "restore": restore,
        "setup": max(0.0, sum(finite(r.time_to_recover_s) for r in recovered) - known_recovery),
        "redone": sum(_redone(f, per_step) for f in failures),
        "preemption": _notice_waits(failures),
        "resize": _planned_resizes(resizes),
        "shutdown": max(0.0, end - finished) if finished else 0.0,
    }
    _count_once(buckets, wall_s)
    buckets["other"] = wall_s - sum(buckets.values())
    return Goodput(
        wall_s=wall_s,
        ettr=busy / wall_s if wall_s > 0 else 0.0,
        buckets=Buckets(**buckets),
        memory_snapshot_s=finite(metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME)),
    )


def write_goodput_plot(path: str, jobs: list[tuple[str, dict[str, float]]]) -> None:
    """One stacked bar per job: its wall clock split into the buckets, ETTR on top."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 1.2 * len(jobs) + 3), 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    from matplotlib import colormaps

    colours = colormaps["tab20"]  # one colour per bucket (the default cycle has 10)
    labels = [label for label, _ in jobs]
    bottoms = [0.0] * len(jobs)
    for i, name in enumerate(BUCKETS):
        heights = [max(0.0, buckets.get(name, 0.0)) for _, buckets in jobs]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=name, color=colours(i))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, (_, buckets) in enumerate(jobs):
        wall = sum(buckets.values())
        ettr = buckets.get("training", 0.0) / wall if wall > 0 else 0.0
        ax.annotate(f"ETTR {ettr:.2f}", (x, bottoms[x]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds of wall clock")
    ax.set_title("goodput: where each job's time went" if jobs else "no job reported goodput")
    if jobs:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    # Rotated labels end under their own bar (centred, a long one would sit under the next).
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", rotation_mode="anchor")
    fig.savefig(path, dpi=100)


# -- the first-order model: ETTR against the checkpoint interval -----------------------------


MODELED = (
    "training",
    "data_wait",
    "checkpoint",
    "detection",
    "restart",
    "restore",
    "setup",
    "redone",
)


def predict_ettr(
    goodput: Goodput,
    checkpoints: int,
    failures: int,
    mtbf_s: float | None,
    max_failures: int | None = None,
    snapshots: int = 0,
) -> Prediction | None:
    """The first-order model's ETTR for a run, from the run's own measurements: checkpoint
    cost C (stall per checkpoint), the interval τ (training and batch wait per checkpoint),
    recovery R (detection + restart + restore + set-up per failure) and the declared mean time
    between failures (expected failures over the modeled time, at most ``max_failures``: a kill
    schedule's cap; without a rate, exactly ``max_failures``). Every τ of training pays C; every
    failure costs R and, on average, half the interval between the states it can restore of
    work done again: τ/2, or with the memory tier (``snapshots`` taken) half the snapshot
    interval -- then the optimum is the snapshot cadence's, for the snapshot's cost. Start-up,
    validation and shutdown are taken as measured. None without a checkpoint."""
    b, wall = goodput.buckets, goodput.wall_s
    step_time = b.training + b.data_wait
    if checkpoints <= 0 or wall <= 0 or step_time <= 0:
        return None
    stall = finite(goodput.memory_snapshot_s)  # the memory tier's, in "checkpoint"
    cost = (b.checkpoint - stall) / checkpoints
    interval = step_time / checkpoints
    recovery = b.detection + b.restart + b.restore + b.setup
    recovery = recovery / failures if failures else 0.0
    modeled = sum(b.seconds()[k] for k in MODELED)
    expected = modeled / mtbf_s if mtbf_s else float(max_failures or 0)
    if max_failures is not None:
        expected = min(expected, max_failures)
    # What a failure loses: back to the newest checkpoint, or the newest memory snapshot.
    lost_every, lost_cost = interval, cost
    if snapshots > 0:  # both tiers' states are restorable
        lost_every, lost_cost = step_time / (snapshots + checkpoints), stall / snapshots
    overhead = b.checkpoint / step_time  # every tier's stalls per second trained
    useful = max(0.0, modeled - expected * (recovery + lost_every / 2)) / (1 + overhead)
    return Prediction(
        ettr=useful * (b.training / step_time) / wall,
        checkpoint_cost_s=cost,
        interval_s=interval,
        restorable_every_s=lost_every,
        recovery_s=recovery,
        expected_failures=expected,
        optimal_interval_s=optimal_interval_s(lost_cost, modeled / expected) if expected else None,
    )
