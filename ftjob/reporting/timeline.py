"""``timeline.png``: a run as a story in time, drawn from its summary.json alone.

Three rows on one wall clock (seconds since the driver started): what the run was doing --
start-up, each failure's detection, restart, restore and set-up at their real lengths, each
preemption notice's window, each planned resize, the shutdown -- with the kills, hangs and
notices marked where they happened; the world size and images/s; train loss and validation
accuracy. The title carries the status and ETTR, the legend the goodput buckets' totals.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from ftjob.metrics import finite
from ftjob.record import HistoryPoint, ValidationResult
from ftjob.reporting.run_summary import Buckets, FailureRecord, RunSummary

TIMELINE_FILE = "timeline.png"

# Phase colours: one per kind of time that is not training.
PHASES = {
    "startup": "#9e9e9e",
    "detection": "#e53935",
    "restart": "#fb8c00",
    "restore": "#8e24aa",
    "setup": "#fdd835",
    "preemption": "#1e88e5",
    "resize": "#00897b",
    "shutdown": "#616161",
}

# The buckets the training band holds besides training itself (no phase of their own).
IN_TRAINING = {
    "data_wait": "data wait",
    "validation": "validation",
    "checkpoint": "checkpoints",
    "redone": "redone steps",
}


def training_label(buckets: Buckets) -> str:
    """The training band's legend entry: its training seconds, and the other buckets it spans
    (waiting for data, validating, checkpointing, steps trained again): most of the band's
    other seconds."""
    seconds = buckets.seconds()
    label = f"training ({finite(buckets.training):.1f} s)"
    within = [
        f"{name} {finite(seconds[key]):.1f}"
        for key, name in IN_TRAINING.items()
        if finite(seconds[key]) >= 0.05
    ]
    return label + (f"\nwith {', '.join(within)} s" if within else "")


MARKS = {"kill": "#b71c1c", "hang": "#4a148c", "notice": "#0d47a1", "failure": "#e65100"}


def origin(summary: RunSummary) -> float:
    """Second 0 of the picture: when the driver started, as goodput counts (its legend's
    seconds); the run ledger's start for a summary older than ``timing.run_started``."""
    timing = summary.timing
    started = timing.run_started if timing.run_started is not None else timing.started
    return finite(started)


def _failure_spans(f: FailureRecord, t0: float) -> list[tuple[str, float, float]]:
    """A failure's detection, restart, restore and set-up, in that order (after its notice's
    window, when a notice came first)."""
    spans: list[tuple[str, float, float]] = []
    if f.time is None:
        return spans
    notice = f.preemption.notice if f.preemption is not None else None
    if notice is not None and notice.received and notice.deadline:  # the notice came first
        spans.append(("preemption", notice.received - t0, notice.deadline - t0))
    at, r = f.time - t0, f.recovery
    parts = [("detection", finite(f.detection_s))]
    if r is not None:
        parts += [("restart", finite(r.restart_s)), ("restore", finite(r.restoration_s))]
        if r.time_to_recover_s is not None:  # its first step is training, as goodput counts it
            rest = finite(r.time_to_recover_s) - finite(r.first_step_s) - sum(s for _, s in parts)
            parts.append(("setup", max(0.0, rest)))
    for name, seconds in parts:
        if seconds > 0:
            spans.append((name, at, at + seconds))
            at += seconds
    return spans


def phase_spans(summary: RunSummary) -> list[tuple[str, float, float]]:
    """(phase, start, end) in seconds since the run started, for every phase the summary
    measured; a failure's are its detection, restart, restore and set-up, in that order.
    Start-up ends where the first step began (that step is training), as goodput counts it."""
    t0, timing = origin(summary), summary.timing
    spans: list[tuple[str, float, float]] = []
    first, finished = timing.first_step, timing.finished
    if first:
        spans.append(("startup", 0.0, first - finite(timing.first_step_took) - t0))
    for f in summary.failures:
        spans += _failure_spans(f, t0)
    for r in summary.resizes:  # a planned one; its first step is training's
        if r.cause == "planned" and r.time and r.time_to_recover_s:
            took = max(0.0, r.time_to_recover_s - finite(r.first_step_s))
            spans.append(("resize", r.time - t0, r.time - t0 + took))
    if finished:
        spans.append(("shutdown", finished - t0, finite(summary.wall_time_s)))
    return spans


def marks(summary: RunSummary) -> list[tuple[str, float, str]]:
    """(kind, seconds since the start, label): kills, hangs, preemption notices."""
    t0, out = origin(summary), []
    for i, k in enumerate(summary.chaos.kills, start=1):
        out.append(("kill", k.time - t0, f"kill {i} ({k.kind})"))
    for h in summary.hangs:
        out.append(("hang", h.time - t0, f"hang rank {h.rank}"))
    for f in summary.failures:
        notice = f.preemption.notice if f.preemption is not None else None
        if notice is not None and notice.received:
            out.append(("notice", notice.received - t0, f"notice ({notice.source})"))
        elif f.kind in ("injected", "error") and f.time:
            out.append(("failure", f.time - t0, f"failure ({f.kind})"))
    return out


def write_timeline(path: str, summary: RunSummary) -> None:
    """Draw ``summary`` (summary.json) to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not summary.timing.started:
        raise ValueError("summary.json has no timing (written by an older ftjob?)")
    t0, wall = origin(summary), finite(summary.wall_time_s)
    fig = Figure(figsize=(13, 8), layout="constrained")
    FigureCanvasAgg(fig)
    phases_ax, rate_ax, loss_ax = fig.subplots(3, 1, sharex=True, height_ratios=[1.1, 1, 1])
    fig.suptitle(
        f"{summary.name}: {summary.status}, wall {wall:.0f} s, "
        f"ETTR {finite(summary.goodput.ettr):.2f}",
        fontsize=12,
    )
    found = marks(summary)
    _phases(phases_ax, summary, found)
    history = [h for h in summary.history if h.time]
    times = [finite(h.time) - t0 for h in history]
    _throughput(rate_ax, times, history)
    _quality(loss_ax, times, history, summary.validation, t0)
    for ax in (rate_ax, loss_ax):
        for kind, at, _ in found:
            ax.axvline(at, color=MARKS[kind], lw=1, ls="--", alpha=0.6)
    loss_ax.set_xlim(0, max(wall, 1.0))
    loss_ax.set_xlabel("seconds since the driver started (the console's mm:ss)")
    fig.savefig(path, dpi=100)


def draw_timeline(summary: RunSummary, run_dir: str) -> str:
    """timeline.png in ``run_dir``; the line that says where, or why it was not drawn (a
    picture is never worth failing a run or a report over)."""
    path = os.path.join(run_dir, TIMELINE_FILE)
    try:
        write_timeline(path, summary)
    # A job boundary: matplotlib's own errors, an old summary's missing keys, a full disk --
    # the run's outcome is in summary.json already; the picture's failure is said, not raised.
    except Exception as exc:
        return f"timeline not drawn ({type(exc).__name__}: {exc})"
    return f"timeline: {path}"


def _phases(ax: Any, summary: RunSummary, found: list[tuple[str, float, str]]) -> None:
    """What the run was doing: training, unless a phase says other; marks where things
    happened, labelled (staggered, so marks close in time do not overlap)."""
    from matplotlib.patches import Patch

    ax.axhspan(0, 1, color="#c8e6c9", zorder=0)
    spans = phase_spans(summary)
    for name, start, end in spans:
        ax.axvspan(start, end, ymin=0.0, ymax=1.0, color=PHASES[name], alpha=0.85, lw=0)
    for i, (kind, at, label) in enumerate(found):
        ax.axvline(at, color=MARKS[kind], lw=1.5, ls="--")
        ax.annotate(
            label,
            (at, 1.0 - 0.16 * (i % 4)),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color=MARKS[kind],
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
        )
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    buckets = summary.goodput.buckets
    handles = [Patch(color="#c8e6c9", label=training_label(buckets))]
    drawn = {name for name, _, _ in spans}
    seconds = buckets.seconds()
    for name, colour in PHASES.items():
        if finite(seconds[name]) > 0 or name in drawn:
            handles.append(Patch(color=colour, label=f"{name} ({finite(seconds[name]):.1f} s)"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("phases (goodput buckets, seconds in the legend)", fontsize=9, loc="left")


T = TypeVar("T")


def _by_attempt(
    times: Sequence[float], values: Sequence[T], attempts: Sequence[int | None]
) -> Iterable[tuple[list[float], list[T]]]:
    """(times, values) per attempt: a line is never drawn across a recovery."""
    segments: dict[int | None, tuple[list[float], list[T]]] = {}
    for t, v, a in zip(times, values, attempts, strict=True):
        ts, vs = segments.setdefault(a, ([], []))
        ts.append(t)
        vs.append(v)
    return segments.values()


def _throughput(ax: Any, times: list[float], history: list[HistoryPoint]) -> None:
    """Images/s, and the world size on the right axis."""
    rates = [finite(h.throughput) for h in history]
    attempts = [h.attempt for h in history]
    for ts, vs in _by_attempt(times, rates, attempts):
        ax.plot(ts, vs, "o-", ms=3, color="#3949ab")
    ax.set_ylabel("images/s", color="#3949ab")
    world_ax = ax.twinx()
    sizes = [h.world_size or 0 for h in history]
    for ts, ws in _by_attempt(times, sizes, attempts):
        world_ax.step(ts, ws, where="post", color="#00897b", lw=2)
    world_ax.set_ylabel("workers", color="#00897b")
    most = max(sizes, default=1)
    world_ax.set_ylim(0, most + 1)
    world_ax.set_yticks(range(0, most + 2))


def _quality(
    ax: Any,
    times: list[float],
    history: list[HistoryPoint],
    validations: Sequence[ValidationResult],
    t0: float,
) -> None:
    """Train loss, and validation accuracy on the right axis."""
    losses = [h.loss for h in history]
    for ts, ls in _by_attempt(times, losses, [h.attempt for h in history]):
        ax.plot(ts, ls, "o-", ms=3, color="#d81b60")
    ax.set_ylabel("train loss", color="#d81b60")
    acc_ax = ax.twinx()
    val = [v for v in validations if v.time]
    when, accuracy = [v.time - t0 for v in val], [v.accuracy for v in val]
    for ts, vs in _by_attempt(when, accuracy, [v.attempt for v in val]):
        acc_ax.plot(ts, vs, "s-", ms=4, color="#43a047")
    acc_ax.set_ylabel("validation accuracy", color="#43a047")
    acc_ax.set_ylim(0, 1)


__all__ = [
    "TIMELINE_FILE",
    "draw_timeline",
    "marks",
    "phase_spans",
    "training_label",
    "write_timeline",
]
