"""Sweep tables and plots: one row per job of a Hydra multirun, written into the sweep dir.

A sweep dir holds one dir per job (Hydra's ``hydra.sweep.subdir``, ``0/``, ``1/``... by
default), each with ``.hydra/overrides.yaml`` and, once the job ended, ``summary.json``.
:func:`build_sweep_report` reads only those files, so it works the same at the end of a sweep
(:class:`SweepReportCallback`), and later on a finished, partial or failed sweep
(``python -m ftjob.report DIR``, see :func:`main`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ftjob import metrics as M
from ftjob.config.compose import parse_overrides, sweep_values
from ftjob.config.load import plain_mapping
from ftjob.config.secrets import Redactor, redact_yaml
from ftjob.reporting.goodput import write_goodput_plot
from ftjob.reporting.summary import SUMMARY_FILE
from ftjob.reporting.timeline import TIMELINE_FILE

logger = logging.getLogger("ftjob")

SWEEP_CSV = "sweep_summary.csv"
SWEEP_MD = "sweep_summary.md"
SWEEP_PNG = "sweep_summary.png"
SWEEP_GOODPUT_PNG = "sweep_goodput.png"
OVERRIDES_FILE = os.path.join(".hydra", "overrides.yaml")
MULTIRUN_FILE = "multirun.yaml"
INCOMPLETE = "incomplete"  # a job dir without summary.json: still running, killed, or crashed


@dataclass(frozen=True)
class Outcome:
    """One outcome column: its CSV name (a summary.json metric key where there is one), its
    Markdown header and how many decimals it is shown with."""

    key: str
    header: str
    decimals: int


WALL_TIME = "wall_time_s"
OUTCOMES: tuple[Outcome, ...] = (
    Outcome(WALL_TIME, "wall time (s)", 1),
    Outcome(M.GOODPUT_ETTR, "ETTR", 3),
    Outcome(M.GOODPUT_PREDICTED_ETTR, "predicted ETTR", 3),
    Outcome(M.CHECKPOINT_OPTIMAL_INTERVAL, "optimal checkpoint interval (s)", 1),
    Outcome(M.TRAIN_GLOBAL_THROUGHPUT, "img/s", 0),
    Outcome(M.FAILURES_COUNT, "failures", 0),
    Outcome(M.CHAOS_KILLS, "kills", 0),
    Outcome(M.RECOVERY_TIME_TO_RECOVER, "mean time-to-recover (s)", 1),
    Outcome(M.RECOVERY_LOST_STEPS, "lost steps", 0),
    Outcome(M.CHECKPOINT_UPLOAD_RETRIES, "upload retries", 0),
    Outcome(M.CHECKPOINT_UPLOAD_FAILURES, "upload failures", 0),
    Outcome(M.PREEMPTION_COUNT, "preemptions", 0),
    Outcome(M.PREEMPTION_LOST_STEPS, "preemption lost steps", 0),
    Outcome(M.PREEMPTION_JIT_CHECKPOINT_TIME, "JIT checkpoint (s)", 2),
    Outcome(M.VALIDATION_ACCURACY, "val accuracy", 4),
)
# Plotted against the swept parameters: goodput, recovery cost (kill and checkpoint-interval
# sweeps), total cost, throughput, model quality, and the storage outcomes of retry-policy
# sweeps.
PLOTTED = (
    M.GOODPUT_ETTR,
    M.RECOVERY_TIME_TO_RECOVER,
    M.RECOVERY_LOST_STEPS,
    WALL_TIME,
    M.VALIDATION_ACCURACY,
    M.CHECKPOINT_UPLOAD_RETRIES,
    M.CHECKPOINT_UPLOAD_FAILURES,
    M.TRAIN_GLOBAL_THROUGHPUT,
)
# Drawn dashed in the same panel, in each line's colour: the first-order model's prediction
# beside the measured ETTR.
COMPANION = {M.GOODPUT_ETTR: M.GOODPUT_PREDICTED_ETTR}


@dataclass
class JobRow:
    """What one job dir says: its overrides, and its outcome if it wrote summary.json."""

    job: str  # path relative to the sweep dir, e.g. "0"
    overrides: dict[str, str]
    status: str
    name: str = ""
    error: str | None = None
    # empty when incomplete; None for a figure written as null
    outcomes: dict[str, float | None] = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)  # seconds per goodput bucket
    timeline: str | None = None  # its timeline.png, relative to the sweep dir, if drawn

    @property
    def finished(self) -> bool:
        return self.status != INCOMPLETE


@dataclass(frozen=True)
class SweepReportPaths:
    csv: str
    markdown: str
    plot: str
    goodput: str


# -- reading job dirs ----------------------------------------------------------------------


def _natural_key(text: str) -> list[Any]:
    """'2' < '10': Hydra numbers jobs 0, 1, ... 10 as dir names."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def is_job_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, OVERRIDES_FILE)) or os.path.isfile(
        os.path.join(path, SUMMARY_FILE)
    )


def find_job_dirs(sweep_dir: str) -> list[str]:
    """Job dirs below ``sweep_dir`` (not itself), in job order. A job dir is not searched
    further: its checkpoints can be large trees."""
    found: list[str] = []
    for root, dirs, _files in os.walk(sweep_dir):
        if root != sweep_dir and is_job_dir(root):
            found.append(os.path.relpath(root, sweep_dir))
            dirs.clear()
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]
    return sorted(found, key=_natural_key)


def read_yaml_list(path: str) -> list[str]:
    from omegaconf import OmegaConf

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # a damaged file leaves the row without overrides, not the report
        logger.warning("cannot read %s: %s", path, exc)
        return []
    # Unresolved: a redacted secret reads ${oc.env:FTJOB_...}, set only where it is used.
    return [str(item) for item in loaded] if isinstance(loaded, list) else []


def _number(value: Any) -> float | None:
    """A summary figure; None for one written as null (non-finite, e.g. a diverged loss)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def read_job(sweep_dir: str, job: str) -> JobRow:
    path = os.path.join(sweep_dir, job)
    overrides_path = os.path.join(path, OVERRIDES_FILE)
    overrides = (
        parse_overrides(read_yaml_list(overrides_path)) if os.path.isfile(overrides_path) else {}
    )
    summary_path = os.path.join(path, SUMMARY_FILE)
    if not os.path.isfile(summary_path):
        return JobRow(
            job, overrides, INCOMPLETE, error="no summary.json (still running, or killed)"
        )
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError) as exc:
        return JobRow(job, overrides, INCOMPLETE, error=f"unreadable summary.json ({exc})")
    row = summary_row(job, overrides, summary)
    if os.path.isfile(os.path.join(path, TIMELINE_FILE)):
        row.timeline = f"{job}/{TIMELINE_FILE}"
    return row


def summary_row(job: str, overrides: dict[str, str], summary: dict[str, Any]) -> JobRow:
    metrics = summary.get("metrics") or {}
    outcomes = {o.key: _number(metrics.get(o.key)) for o in OUTCOMES if o.key != WALL_TIME}
    outcomes[WALL_TIME] = _number(summary.get("wall_time_s"))
    error = summary.get("error")
    return JobRow(
        job,
        overrides,
        str(summary.get("status", "failed")),
        name=str(summary.get("name") or ""),
        error=str(error).splitlines()[0] if error else None,
        outcomes=outcomes,
        goodput={
            k: float(v)
            for k, v in ((summary.get("goodput") or {}).get("buckets") or {}).items()
            if isinstance(v, (int, float))
        },
    )


def declared_sweep_keys(sweep_dir: str) -> list[str]:
    """Keys the sweep was asked to vary (command-line sweeps and hydra.sweeper.params), from
    the sweep's multirun.yaml: known even when only one job has run."""
    path = os.path.join(sweep_dir, MULTIRUN_FILE)
    if not os.path.isfile(path):
        return []
    from omegaconf import OmegaConf

    try:
        hydra_cfg = OmegaConf.load(path).hydra
        params = plain_mapping(hydra_cfg.sweeper.get("params"))
        task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
        values = sweep_values(params, [str(o) for o in task] if isinstance(task, list) else [])
    except Exception as exc:  # an unusual sweeper: fall back to the keys that vary
        logger.debug("cannot read the swept keys from %s: %s", path, exc)
        return []
    return values.swept


def swept_keys(rows: Sequence[JobRow], declared: Sequence[str] = ()) -> list[str]:
    """Declared sweep keys plus any override whose value differs between jobs, in the order
    the jobs list their overrides."""
    order: dict[str, None] = {}
    for row in rows:
        order.update(dict.fromkeys(row.overrides))
    order.update(dict.fromkeys(declared))
    varying = {key for key in order if len({row.overrides.get(key) for row in rows}) > 1} | set(
        declared
    )
    return [key for key in order if key in varying]


def read_sweep(sweep_dir: str) -> tuple[list[JobRow], list[str]]:
    rows = [read_job(sweep_dir, job) for job in find_job_dirs(sweep_dir)]
    return rows, swept_keys(rows, declared_sweep_keys(sweep_dir))


# -- tables --------------------------------------------------------------------------------


def _format(value: float | None, decimals: int) -> str:
    return "null" if value is None else f"{value:.{decimals}f}"


def _csv_cell(value: float | None) -> str:
    # Counts as integers, measurements with enough digits to compare runs; null as JSON says.
    if value is None:
        return "null"
    return str(int(value)) if value.is_integer() else f"{value:.6g}"


def table_rows(rows: Sequence[JobRow], keys: Sequence[str]) -> list[dict[str, str]]:
    """One dict per job, CSV column -> cell text. Unknown outcomes (incomplete job) are empty;
    figures written as null are ``null``."""
    table = []
    for row in rows:
        cells = {"job": row.job}
        cells.update({key: row.overrides.get(key, "") for key in keys})
        cells.update({"status": row.status, "name": row.name})
        for outcome in OUTCOMES:
            known = outcome.key in row.outcomes
            cells[outcome.key] = _csv_cell(row.outcomes[outcome.key]) if known else ""
        cells["error"] = row.error or ""
        table.append(cells)
    return table


def csv_columns(keys: Sequence[str]) -> list[str]:
    return ["job", *keys, "status", "name", *(o.key for o in OUTCOMES), "error"]


def write_csv(path: str, rows: Sequence[JobRow], keys: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=csv_columns(keys))
        writer.writeheader()
        writer.writerows(table_rows(rows, keys))


def _md_cell(text: str, limit: int = 120) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def markdown_table(rows: Sequence[JobRow], keys: Sequence[str]) -> str:
    headers = ["job", *keys, "status", *(o.header for o in OUTCOMES), "error", "timeline"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        outcomes = [
            _format(row.outcomes[o.key], o.decimals) if o.key in row.outcomes else "-"
            for o in OUTCOMES
        ]
        cells = [row.job, *(row.overrides.get(k, "") for k in keys), row.status, *outcomes]
        cells.append(row.error or "")
        picture = f"[png]({row.timeline})" if row.timeline else ""
        lines.append("| " + " | ".join([*map(_md_cell, cells), picture]) + " |")
    return "\n".join(lines)


def status_counts(rows: Sequence[JobRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def write_markdown(
    path: str, sweep_dir: str, rows: Sequence[JobRow], keys: Sequence[str], plot_name: str
) -> None:
    swept = ", ".join(f"`{k}`" for k in keys) or "nothing (no key varies between jobs)"
    text = [
        f"# Sweep {os.path.abspath(sweep_dir)}",
        "",
        f"{len(rows)} jobs: {status_counts(rows)}. Swept: {swept}.",
        "",
        markdown_table(rows, keys),
        "",
        f"![outcomes against the swept parameters]({plot_name})",
        "",
        f"![goodput: each job's wall clock by cause]({SWEEP_GOODPUT_PNG})",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(text))


# -- plot ----------------------------------------------------------------------------------


def _as_floats(values: Sequence[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def _x_axis(values: Sequence[str]) -> tuple[dict[str, float], list[float], list[str]]:
    """Position, ticks and tick labels for the x values: numbers on a numeric axis (a tick at
    each value swept), anything else as categories in order of appearance."""
    distinct = list(dict.fromkeys(values))
    numbers = _as_floats(distinct)
    if numbers is None:
        numbers = [float(i) for i in range(len(distinct))]
    position = dict(zip(distinct, numbers, strict=True))
    ordered = sorted(distinct, key=lambda v: position[v])
    return position, [position[v] for v in ordered], ordered


def plot_series(rows: Sequence[JobRow], keys: Sequence[str]) -> dict[str, list[JobRow]]:
    """Finished jobs grouped into lines: one per combination of the swept keys after the
    first (the x axis), labelled 'key=value, ...'."""
    series: dict[str, list[JobRow]] = {}
    for row in rows:
        if row.finished:
            label = ", ".join(f"{k}={row.overrides.get(k, '')}" for k in keys[1:])
            series.setdefault(label, []).append(row)
    return series


def _values(members: Sequence[JobRow], metric: str) -> list[float]:
    values = [r.outcomes.get(metric) for r in members]
    return [math.nan if v is None else float(v) for v in values]


def write_plot(path: str, rows: Sequence[JobRow], keys: Sequence[str]) -> None:
    # The object API with the Agg canvas: no pyplot, no global backend switch in the caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x_key = keys[0] if keys else "job"

    def x_value(row: JobRow) -> str:
        return row.overrides.get(x_key, "") if keys else row.job

    finished = [row for row in rows if row.finished]
    positions, ticks, tick_labels = _x_axis([x_value(row) for row in finished])
    headers = {o.key: o.header for o in OUTCOMES}
    fig = Figure(figsize=(18, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4).flatten()
    series = plot_series(rows, keys)
    for ax, metric in zip(axes, PLOTTED, strict=True):
        companion = COMPANION.get(metric)
        for label, members in series.items():
            members = sorted(members, key=lambda r: positions[x_value(r)])
            xs = [positions[x_value(r)] for r in members]
            ys = _values(members, metric)
            (line,) = ax.plot(xs, ys, marker="o", label=label or None)
            if companion is not None:
                ax.plot(xs, _values(members, companion), ls="--", color=line.get_color())
            failed = [
                (x, y) for x, y, r in zip(xs, ys, members, strict=True) if r.status != "succeeded"
            ]
            if failed:
                ax.plot(*zip(*failed, strict=True), "x", color="red", markersize=10, mew=2)
        title = headers[metric]
        ax.set_title(f"{title} (dashed: {headers[companion]})" if companion else title)
        ax.set_xlabel(x_key)
        if len(ticks) <= 12:  # beyond that matplotlib's own ticks read better
            ax.set_xticks(ticks, tick_labels)
        ax.grid(alpha=0.3)
    if len(series) > 1 or any(label for label in series):
        axes[0].legend(fontsize="small")
    notes = [f"{len(rows)} jobs ({status_counts(rows)})"]
    if any(row.finished and row.status != "succeeded" for row in rows):
        notes.append("red x = failed job")
    if len(finished) < len(rows):
        notes.append(f"{len(rows) - len(finished)} incomplete not shown")
    fig.suptitle("; ".join(notes))
    fig.savefig(path, dpi=100)


# -- the report ----------------------------------------------------------------------------


def build_sweep_report(sweep_dir: str) -> SweepReportPaths:
    """Write sweep_summary.csv, sweep_summary.md and sweep_summary.png into ``sweep_dir``."""
    rows, keys = read_sweep(sweep_dir)
    paths = SweepReportPaths(
        csv=os.path.join(sweep_dir, SWEEP_CSV),
        markdown=os.path.join(sweep_dir, SWEEP_MD),
        plot=os.path.join(sweep_dir, SWEEP_PNG),
        goodput=os.path.join(sweep_dir, SWEEP_GOODPUT_PNG),
    )
    write_csv(paths.csv, rows, keys)
    write_plot(paths.plot, rows, keys)
    labelled = [
        (" ".join([row.job, *(f"{k}={row.overrides.get(k, '')}" for k in keys)]), row.goodput)
        for row in rows
        if row.goodput
    ]
    write_goodput_plot(paths.goodput, labelled)
    write_markdown(paths.markdown, sweep_dir, rows, keys, SWEEP_PNG)
    return paths


def redact_sweep_record(sweep_dir: str, redactor: Redactor) -> None:
    """Hydra's sweeper writes the sweep's config and command line (multirun.yaml) before any
    job starts, whatever the launcher: rewrite it without their secrets (each job of a sweep
    may: once redacted it stays as it is)."""
    path = os.path.join(sweep_dir, MULTIRUN_FILE)
    if os.path.isfile(path):
        redact_yaml(path, redactor)


class SweepReportCallback(Callback):
    """Registered in conf/config.yaml: after a ``-m`` sweep, report on all its jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = str(config.hydra.sweep.dir)
        try:
            paths = build_sweep_report(sweep_dir)
        except Exception:  # the jobs' own results are already on disk: never lose them here
            logger.exception("could not build the sweep report in %s", sweep_dir)
            return
        print(report_text(paths), flush=True)
        try:
            said = mirror_sweep_report(config, sweep_dir)
        # The report is on disk: its copy (a storage client's own errors, a bad key) is said,
        # never raised past the sweep.
        except Exception as exc:
            logger.warning(
                "the sweep report was not copied to storage: %s: %s", type(exc).__name__, exc
            )
            return
        if said:
            print(said, flush=True)


def mirror_sweep_report(config: DictConfig, sweep_dir: str) -> str | None:
    """The sweep's report copied to ``<checkpoint.storage_path>/sweeps/<DATE_TIME>/`` (the
    sweep's storage, when it names one: the jobs' outputs are beside their checkpoints
    there), through the retrying filesystem; the line that says where, or why not."""
    from ftjob.config import RetryConfig
    from ftjob.reporting.outputs import SWEEPS_DIR, OutputsMirror, sweep_id
    from ftjob.storage.fs import build_filesystem

    node = config.get("checkpoint")
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else None
    if not isinstance(plain, dict) or not plain.get("storage_path"):
        return None
    root = str(plain["storage_path"]).rstrip("/")
    retry = RetryConfig(**dict(plain.get("retry") or {}))
    fs, path = build_filesystem(root, dict(plain.get("storage_options") or {}), retry)
    redactor = Redactor(resolved=plain)
    mirror = OutputsMirror(
        fs, posixpath.join(path, SWEEPS_DIR, sweep_id(sweep_dir)), sweep_dir, redactor
    )
    warning = mirror.close()
    return warning or f"sweep report copied to {mirror.url}"


def report_text(paths: SweepReportPaths) -> str:
    with open(paths.markdown) as f:
        table = "\n".join(line for line in f.read().splitlines() if line.startswith("|"))
    return f"{table}\nsweep report: {paths.csv}, {paths.markdown}, {paths.plot}, {paths.goodput}"
