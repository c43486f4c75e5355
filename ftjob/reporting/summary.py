"""A run's summary: summary.json (:class:`ftjob.reporting.run_summary.RunSummary`) built from
the run ledger's snapshot, written, read back, and printed for a person.

:func:`build_summary` is a pure function of the ledger snapshot (the verdict it is given comes
from :func:`ftjob.reporting.verdict.decide_status`, pure too), so every figure in summary.json
can be recomputed and tested without Ray. The runner writes it; sweep tables
(:mod:`ftjob.reporting.sweep`) and ``python -m ftjob.report`` read it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping

from ftjob import metrics as M
from ftjob.config import ENDS_ATTEMPT
from ftjob.config.secrets import Redactor
from ftjob.metrics import finite, fmt
from ftjob.record import RunSnapshot, RunStatus, Tier
from ftjob.reporting.audit import audit_batches, audit_report
from ftjob.reporting.failures import PREEMPTION, failure_records, hang_metrics, preemption_metrics
from ftjob.reporting.goodput import goodput, predict_ettr
from ftjob.reporting.resizes import resize_records, time_below_full
from ftjob.reporting.run_summary import (
    ChaosSection,
    CheckpointsSection,
    DataSection,
    FailureRecord,
    Goodput,
    ResizeRecord,
    RunSummary,
    StorageCounts,
    Timing,
)
from ftjob.storage.retry import OpStats, StorageStats

SUMMARY_FILE = "summary.json"


def storage_totals(snap: RunSnapshot, extra: StorageStats | None = None) -> StorageStats:
    total = StorageStats()
    for stats in snap.storage.values():
        total.merge(StorageStats.from_dict(stats))
    if extra is not None:
        total.merge(extra)
    return total


def timing(snap: RunSnapshot, run_started: float | None) -> Timing:
    """Wall-clock times: the driver started (``run_started``: the origin of goodput's clock
    and the timeline's), the run ledger started (after the cluster), the first attempt's
    train function started on rank 0, the run's first step ended (and what that step took:
    its batch wait and the step), the run finished."""
    first = snap.first_step
    return Timing(
        run_started=snap.started if run_started is None else run_started,
        started=snap.started,
        workers_started=snap.attempts[0].started if snap.attempts else None,
        first_step=first.time if first else None,
        first_step_took=first.took if first else None,
        finished=snap.finished,
    )


def summary_metrics(
    snap: RunSnapshot, failures: tuple[FailureRecord, ...], storage: StorageStats
) -> dict[str, float]:
    """Every key of :data:`ftjob.metrics.METRIC_KEYS`: the workers' last reported values, and
    the figures only the whole run knows (restores, storage, failures, recovery)."""
    upload = storage.kind("upload")
    metrics = {key: 0.0 for key in M.METRIC_KEYS}
    metrics.update({k: v for k, v in snap.metrics.items() if k in metrics})
    recovered = [f.time_to_recover_s for f in failures]
    times = [t for t in recovered if t is not None]
    restores = snap.restores()
    download = sum(r.download for r in restores)
    load = sum(r.load for r in restores)
    skip = sum(r.skip for r in restores)
    # Timers are finite unless a clock misbehaved; a null one does not poison the rate.
    busy = sum(
        finite(metrics[k]) for k in (M.TRAIN_STEP, M.TRAIN_ITER_BATCH, M.TRAIN_ITER_FIRST_BATCH)
    )
    last_val = snap.validations[-1] if snap.validations else None
    metrics.update(
        {
            M.CHECKPOINT_DOWNLOAD: download,
            M.CHECKPOINT_LOAD: load,
            M.TRAIN_ITER_SKIP_BATCH: skip,
            M.CHECKPOINT_RESTORATION_TIME: download + load + skip,
            M.CHECKPOINT_MEMORY_RESTORES: sum(1 for r in restores if r.tier == Tier.memory),
            M.TRAIN_GLOBAL_THROUGHPUT: finite(metrics[M.TRAIN_ROWS_PROCESSED]) / busy
            if busy
            else 0.0,
            M.VALIDATION_LOSS: last_val.loss if last_val else 0.0,
            M.VALIDATION_ACCURACY: last_val.accuracy if last_val else 0.0,
            M.CHECKPOINT_UPLOAD_ATTEMPTS: upload.attempts,
            M.CHECKPOINT_UPLOAD_RETRIES: upload.retries,
            M.CHECKPOINT_UPLOAD_FAILURES: upload.failures,
            M.CHECKPOINT_RETRY_WAIT: round(upload.retry_wait_s, 4),
            M.CHAOS_KILLS: len(snap.kills),
            M.FAILURES_COUNT: sum(1 for f in failures if f.kind != PREEMPTION),
            M.RECOVERY_TIME_TO_RECOVER: statistics.fmean(times) if times else 0.0,
            M.RECOVERY_LOST_STEPS: sum(f.lost_steps for f in failures),
            **preemption_metrics(snap, failures),
            **hang_metrics(snap),
        }
    )
    return metrics


def declared_failures(config: Mapping[str, object]) -> tuple[float | None, int | None]:
    """The failure rate a run declared, for the model: (mean seconds between failures, at
    most this many failures). A kill schedule: one per window, at most max_kills (at_steps:
    exactly that many); else failure.expected_mtbf_s."""
    chaos, failure = config.get("chaos") or {}, config.get("failure") or {}
    assert isinstance(chaos, Mapping) and isinstance(failure, Mapping)  # the config's groups
    if chaos.get("kind") in ENDS_ATTEMPT:
        if chaos.get("at_steps"):
            return None, len(chaos["at_steps"])
        if chaos.get("max_kills"):
            return chaos.get("interval"), chaos["max_kills"]
    return failure.get("expected_mtbf_s"), None


def build_summary(
    snap: RunSnapshot,
    *,
    name: str,
    status: RunStatus,
    error: str | None,
    wall_time_s: float,
    config: Mapping[str, object],
    driver_storage: StorageStats | None = None,
    run_started: float | None = None,
) -> RunSummary:
    """``run_started``: when the driver started (the goodput clock; default: the ledger's
    start, which misses the driver's own start-up)."""
    failures = failure_records(snap)
    resizes = resize_records(snap, failures)
    storage = storage_totals(snap, driver_storage)
    metrics = summary_metrics(snap, failures, storage)
    started = snap.started if run_started is None else run_started
    accounted = _accounted(snap, metrics, failures, resizes, wall_time_s, started, config)
    audited = bool(snap.audit)
    return RunSummary(
        name=name,
        status=status,
        error=error,
        wall_time_s=wall_time_s,
        metrics=dict(metrics),
        progress=snap.progress,
        history=snap.history,
        failures=failures,
        chaos=ChaosSection(kills=snap.kills, skipped=snap.chaos_skipped, injected=snap.injected),
        checkpoints=checkpoints_record(snap),
        storage=storage_record(storage),
        validation=snap.validations,
        validation_replaced=snap.replaced_validations,
        attempts=len(snap.attempts),
        hangs=snap.watch.hangs,
        stragglers=snap.watch.stragglers,
        section_timeouts=snap.watch.sections,
        config=dict(config),
        data=DataSection(
            skipped=len(snap.skipped_files), skipped_files=snap.skipped_files, decode=snap.decode
        ),
        audit=audit_report(snap) if audited else None,
        audit_batches=audit_batches(snap) if audited else None,
        world_sizes=tuple(a.world_size for a in snap.attempts),
        resizes=resizes,
        timing=timing(snap, run_started),
        goodput=accounted,
    )


def _accounted(
    snap: RunSnapshot,
    metrics: dict[str, float],
    failures: tuple[FailureRecord, ...],
    resizes: tuple[ResizeRecord, ...],
    wall_time_s: float,
    started: float,
    config: Mapping[str, object],
) -> Goodput:
    """Where the wall clock went since ``started`` (when the driver started), and what the
    first-order model predicts; the metrics that say them set in ``metrics``."""
    metrics[M.ELASTIC_RESIZES] = len(resizes)
    metrics[M.ELASTIC_TIME_BELOW_FULL] = time_below_full(
        snap.attempts, snap.plan.num_workers, started + wall_time_s
    )
    first = snap.first_step
    accounted = goodput(
        wall_s=wall_time_s,
        run_started=started,
        first_step=first.time if first else None,
        first_step_took=first.took if first else 0.0,
        finished=snap.finished,
        metrics=metrics,
        failures=failures,
        resizes=resizes,
    )
    metrics[M.GOODPUT_ETTR] = accounted.ettr
    steps = {c.step for c in snap.checkpoints}  # each checkpointed step once
    recovered = sum(1 for f in failures if f.recovered)
    snapshots = int(metrics[M.CHECKPOINT_MEMORY_SNAPSHOTS])  # the memory tier's, if on
    predicted = predict_ettr(
        accounted, len(steps), recovered, *declared_failures(config), snapshots
    )
    if predicted is not None:
        metrics[M.GOODPUT_PREDICTED_ETTR] = predicted.ettr
        metrics[M.CHECKPOINT_OPTIMAL_INTERVAL] = predicted.optimal_interval_s or 0.0
    return dataclasses.replace(accounted, predicted=predicted)


def checkpoints_record(snap: RunSnapshot) -> CheckpointsSection:
    committed = snap.committed()
    return CheckpointsSection(
        committed=len(committed),
        failed=len(snap.checkpoints) - len(committed),
        latest=committed[-1].path if committed else None,
        fallbacks=tuple(fb for r in snap.restores() for fb in r.skipped),
    )


def storage_record(storage: StorageStats) -> dict[str, StorageCounts]:
    """Each kind of storage request's counts, and their ``total``."""
    total = OpStats()
    for stats in storage.by_kind.values():
        total.merge(stats)
    kinds = {**{k: storage.by_kind[k] for k in sorted(storage.by_kind)}, "total": total}
    return {kind: StorageCounts.from_json(stats.as_dict()) for kind, stats in kinds.items()}


def write_summary(summary: RunSummary, run_dir: str) -> str:
    """summary.json in ``run_dir`` (by rename: a reader never sees half of it)."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary.document(), f, indent=2)
    os.replace(tmp, path)
    return path


def read_summary(path: str) -> RunSummary:
    """A summary.json read back (an older one's missing parts are their defaults)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return RunSummary.from_json(data)


def _event_lines(summary: RunSummary) -> list[str]:
    """Resizes, hangs, stragglers and skipped chaos, one line each."""
    lines: list[str] = []
    for r in summary.resizes:
        ttr = r.time_to_recover_s
        lines.append(
            f"  resize at attempt {r.attempt}: {r.kind} {r.from_} -> {r.to} workers "
            f"({r.cause}), lost {r.lost_steps} steps"
            + (f", training again after {ttr:.1f}s" if ttr is not None else "")
        )
    for h in summary.hangs:
        lines.append(
            f"  hang: rank {h.rank} in {h.section} at step {h.step}, found after "
            f"{finite(h.stalled_for_s):.1f}s without progress (timeout {finite(h.timeout_s):.0f}s); "
            f"stack: {h.stack_source or 'not captured'}"
        )
    for s in summary.stragglers.flagged:
        lines.append(
            f"  straggler: rank {s.rank} {finite(s.slowdown):.2f}x slower than the fastest rank"
            + (" (restarted)" if s.restarted else "")
        )
    for skip in summary.chaos.skipped:
        lines.append(f"  chaos: no {skip.kind} kill: {skip.reason}")
    bad = summary.data.skipped_files
    if bad:
        lines.append(
            f"  data: {len(bad)} bad file(s) skipped (dataset.bad_files=skip; summary.json "
            "data.skipped_files):"
        )
        lines.extend(f"    {f.path} ({f.reason})" for f in bad[:20])
        lines.extend([f"    ... and {len(bad) - 20} more"] if len(bad) > 20 else [])
    return lines


def _failure_line(f: FailureRecord) -> str:
    r = f.recovery
    if r is None and f.recovered:
        return f"  failure {f.attempt}: {f.kind} as the group started again, recovered with it"
    if r is None or r.time_to_recover_s is None:
        return f"  failure {f.attempt}: {f.kind}, not recovered"
    return (
        f"  failure {f.attempt}: {f.kind}, detect {finite(f.detection_s):.1f}s, restart "
        f"{finite(r.restart_s):.1f}s, download {r.download_s:.2f}s, load {r.load_s:.2f}s, skip "
        f"{r.skip_s:.3f}s -> recovered in {r.time_to_recover_s:.1f}s (lost {r.lost_steps} steps)"
    )


def format_summary(summary: RunSummary) -> str:
    """The summary a person reads: at the end of a run, and from ``python -m ftjob.report``.
    Reads any summary.json, also one of a job that never started (figures then 0)."""
    m = {key: summary.metrics.get(key, 0.0) for key in M.METRIC_KEYS}
    error = summary.error
    checkpoints = summary.checkpoints
    lines = [
        f"run {summary.name or '?'}: {summary.status}, wall time "
        f"{finite(summary.wall_time_s):.1f} s" + (f" -- {error}" if error else ""),
        f"  steps {fmt(m[M.TRAIN_STEPS_COMPLETED], '.0f')} ({fmt(m[M.TRAIN_STEP], '.1f')} s in them: "
        f"train/step), {fmt(m[M.TRAIN_GLOBAL_THROUGHPUT], '.0f')} img/s, "
        f"train loss {fmt(m[M.TRAIN_LOSS])}, validation accuracy {fmt(m[M.VALIDATION_ACCURACY])} "
        f"(loss {fmt(m[M.VALIDATION_LOSS])})",
        f"  checkpoints committed {checkpoints.committed}, upload retries "
        f"{fmt(m[M.CHECKPOINT_UPLOAD_RETRIES], '.0f')}, upload failures {fmt(m[M.CHECKPOINT_UPLOAD_FAILURES], '.0f')}",
        f"  kills {fmt(m[M.CHAOS_KILLS], '.0f')}, failures {fmt(m[M.FAILURES_COUNT], '.0f')}, mean time-to-recover "
        f"{fmt(m[M.RECOVERY_TIME_TO_RECOVER], '.1f')}s, restoration {fmt(m[M.CHECKPOINT_RESTORATION_TIME], '.2f')}s, "
        f"lost steps {fmt(m[M.RECOVERY_LOST_STEPS], '.0f')}",
    ]
    if (done := summary.already_finished) is not None:  # resume=auto of a finished run
        return _already_finished(lines[0], done.step, done.checkpoint)
    buckets = summary.goodput.buckets.seconds()
    if summary.goodput.wall_s or any(buckets.values()):
        spent = ", ".join(f"{k} {v:.1f}" for k, v in buckets.items() if v >= 0.05 or v <= -0.05)
        lines.append(f"  goodput: ETTR {fmt(m[M.GOODPUT_ETTR], '.3f')}; seconds: {spent}")
    if m[M.PREEMPTION_COUNT]:
        lines.append(
            f"  preemptions {fmt(m[M.PREEMPTION_COUNT], '.0f')}: lost steps "
            f"{fmt(m[M.PREEMPTION_LOST_STEPS], '.0f')}, just-in-time checkpoints "
            f"{fmt(m[M.PREEMPTION_JIT_CHECKPOINT_TIME], '.2f')}s"
        )
    lines.extend(_failure_line(f) for f in summary.failures)
    lines.extend(_event_lines(summary))
    for a in summary.audit or ():
        lines.append(
            f"  audit epoch {a.epoch}: unique {a.unique}, duplicates {a.duplicates}, missing {a.missing}"
        )
    return "\n".join(lines)


def _already_finished(head: str, step: object, checkpoint: object) -> str:
    """``resume=auto`` found the run finished: nothing was trained by this command, so no
    figures are printed -- zeros would read as a run that trained nothing."""
    return f"{head}\n  already finished at step {step} ({checkpoint}): this command trained nothing"


def plain_config(config: object) -> dict[str, object]:
    """A job's config as plain data: an OmegaConf node as containers, its interpolations as
    written (``${hydra:...}`` resolves only in the job's own process)."""
    from omegaconf import DictConfig, OmegaConf

    plain = (
        OmegaConf.to_container(config, resolve=False) if isinstance(config, DictConfig) else config
    )
    if not isinstance(plain, Mapping):
        raise TypeError(f"a job's config is a mapping, not {type(config).__name__}")
    return {str(k): v for k, v in plain.items()}


def write_failed_summary(
    run_dir: str,
    error: str,
    config: object,
    snapshot: RunSnapshot,
    redactor: Redactor | None = None,
    status: RunStatus = RunStatus.failed,
) -> str:
    """summary.json for a job that could not start (so a sweep still reports it): ``snapshot``
    is an empty run record; ``config`` the job's config (an OmegaConf node or plain), with
    the secrets ``redactor`` knows redacted."""
    plain = plain_config(config)
    if redactor is not None:
        plain = redactor.config(plain)
    summary = build_summary(
        snapshot, name="", status=status, error=error, wall_time_s=0.0, config=plain
    )
    if redactor is not None:
        summary = RunSummary.from_json(redactor.strings(summary.document()))
    return write_summary(summary, run_dir)
