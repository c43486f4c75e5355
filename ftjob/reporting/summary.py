"""A run's result: its status, summary.json and the human summary printed at its end.

:func:`decide_status` and :func:`build_summary` are pure functions of the ledger snapshot (and
of how ``fit()`` ended), so every figure in summary.json, and the verdict itself, can be
recomputed and tested without Ray. The runner writes it; sweep tables (:mod:`ftjob.reporting.sweep`) and
``python -m ftjob.report`` read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ftjob import metrics as M
from ftjob.config import ENDS_ATTEMPT
from ftjob.data.order import ShuffleWindows, epoch_order
from ftjob.metrics import finite, fmt
from ftjob.record import AuditStep, RunSnapshot, RunStatus, Tier
from ftjob.reporting.failures import PREEMPTION, failure_records, hang_metrics, preemption_metrics
from ftjob.reporting.goodput import goodput, predict_ettr
from ftjob.reporting.resizes import resize_records, time_below_full
from ftjob.storage.retry import StorageStats

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class FitOutcome:
    """How ``TorchTrainer.fit()`` ended, as plain data."""

    error: str | None = None  # the root error, one line; None when fit() returned
    budget_exhausted: bool = False  # Ray Train gave up: more failures than failure.max_failures
    interrupted: bool = False  # the user stopped the run (Ctrl-C)
    preempted: bool = False  # the driver got a preemption notice (SIGTERM) and stopped the run
    preemption_budget_exhausted: bool = False  # more preemptions than failure.max_preemptions
    stopped_at: str | None = None  # where an interrupted or preempted run stood, if not training


def decide_status(
    snap: RunSnapshot, fit: FitOutcome, max_failures: int, max_preemptions: int = -1
) -> tuple[RunStatus, str | None]:
    """How the run ended, and why (one line; None when it succeeded). A run succeeds only when
    fit() returned, no rank declared the job fatally failed, the last step was trained and,
    when audited, every sample was trained exactly once."""
    if fit.interrupted:
        return (
            RunStatus.interrupted,
            f"interrupted (Ctrl-C) {fit.stopped_at or 'before the last step'}",
        )
    if fit.preempted and fit.stopped_at:
        return RunStatus.preempted, f"stopped by a preemption notice (SIGTERM) {fit.stopped_at}"
    if fit.preempted:
        notice = snap.attempts[-1].preemption if snap.attempts else None
        jit = notice.jit if notice is not None else None
        saved = (
            f"after a just-in-time checkpoint of step {jit.step}"
            if jit and jit.path
            else "without a just-in-time checkpoint"
            + (f" ({jit.reason})" if jit and jit.reason else "")
        )
        return RunStatus.preempted, f"stopped by a preemption notice (SIGTERM) {saved}"
    if fit.preemption_budget_exhausted:
        count = sum(1 for a in snap.attempts if a.preemption is not None)
        return RunStatus.failed, (
            f"training stopped after {count} preemption(s), over the budget "
            f"failure.max_preemptions={max_preemptions}: {fit.error}"
        )
    if snap.fatal:  # ftjob stopped the job (a failure after it is its consequence)
        return RunStatus.failed, snap.fatal
    if fit.error is not None:
        if fit.budget_exhausted:
            return RunStatus.failed, (
                f"training failed after {len(snap.failures)} failure(s), over the budget "
                f"failure.max_failures={max_failures}: {fit.error}"
            )
        return RunStatus.failed, fit.error
    if snap.finished is None:
        return RunStatus.failed, "training ended before the last epoch"
    broken = [a for a in (audit_report(snap) if snap.audit else []) if not exactly_once(a)]
    if broken:
        a = broken[0]
        return RunStatus.failed, (
            f"exact-once broken: epoch {a['epoch']} trained {a['duplicates']} duplicate, "
            f"{a['missing']} missing and {a['unexpected']} unexpected sample(s), "
            f"{a.get('misplaced', 0)} step(s) not on their global batch "
            f"({len(broken)} epoch(s) affected; see summary.json audit)"
        )
    return RunStatus.succeeded, None


def exactly_once(epoch_audit: dict[str, Any]) -> bool:
    return not (
        epoch_audit["duplicates"]
        or epoch_audit["missing"]
        or epoch_audit["unexpected"]
        or epoch_audit.get("misplaced", 0)
    )


def storage_totals(snap: RunSnapshot, extra: StorageStats | None = None) -> StorageStats:
    total = StorageStats()
    for stats in snap.storage.values():
        total.merge(StorageStats.from_dict(stats))
    if extra is not None:
        total.merge(extra)
    return total


def _surviving_steps(snap: RunSnapshot) -> list[AuditStep]:
    """The audited steps the final model was trained on: steps an attempt trained past the
    checkpoint the next attempt restored were thrown away with that attempt (lost work)."""
    restored = {a.index: a.restored.step if a.restored else 0 for a in snap.attempts}
    last = max(restored) if restored else 0
    kept = []
    for entry in snap.audit:
        a, step = entry.attempt, entry.step
        upper = restored.get(a + 1, float("inf")) if a < last else float("inf")
        if restored.get(a, 0) < step <= upper:
            kept.append(entry)
    return sorted(kept, key=lambda e: e.step)


def batch_digest(ids: Sequence[int]) -> str:
    """A global batch's identity, whatever the order its ranks sent their slices in."""
    return hashlib.sha256(np.sort(np.asarray(ids, dtype=np.int64)).tobytes()).hexdigest()[:16]


def audit_report(snap: RunSnapshot) -> list[dict[str, Any]]:
    """Per epoch: which samples the final model was trained on, across attempts, and whether
    each step trained the global batch the data order gives it (``misplaced`` counts steps
    that did not: at any world size, step k trains the same samples).

    Everything must cover each epoch's samples exactly once. A resumed run (``resume=true``)
    starts in the middle of an epoch: the samples before the position it resumed at were
    trained by the run it continues (``resumed_at`` counts them) and are not expected again.
    A sample skipped as a bad file (dataset.bad_files=skip) is seen at its place and not
    trained: ``skipped`` counts them, ``trained`` the rest."""
    plan = snap.plan
    first = snap.attempts[0].restored if snap.attempts else None
    resumed_epoch, resumed_at = (first.epoch, first.position) if first else (None, 0)
    B, per_epoch_steps = plan.global_batch_size, plan.steps_per_epoch
    windows = (
        ShuffleWindows(plan.group_sizes, plan.group_counts, plan.shuffle_window)
        if plan.shuffle_window
        else None
    )
    per_epoch: dict[int, list[int]] = {}
    skipped: dict[int, int] = {}
    misplaced: dict[int, int] = {}
    orders: dict[int, np.ndarray] = {}
    for entry in _surviving_steps(snap):
        epoch = entry.epoch
        per_epoch.setdefault(epoch, []).extend(entry.ids)
        skipped[epoch] = skipped.get(epoch, 0) + len(entry.skipped or ())
        if epoch not in orders:
            orders[epoch] = epoch_order(plan.num_samples, plan.seed, epoch, windows)
        k = (entry.step - 1) % per_epoch_steps
        planned = orders[epoch][k * B : (k + 1) * B]
        if batch_digest(entry.ids) != batch_digest(planned.tolist()):
            misplaced[epoch] = misplaced.get(epoch, 0) + 1
    out = []
    for epoch in sorted(per_epoch):
        ids = np.asarray(per_epoch[epoch], dtype=np.int64)
        start = resumed_at if epoch == resumed_epoch else 0
        expected = orders[epoch][start : plan.samples_per_epoch]
        unique = np.unique(ids)
        out.append(
            {
                "epoch": epoch,
                "resumed_at": start,
                "trained": int(len(ids)) - skipped.get(epoch, 0),
                "skipped": skipped.get(epoch, 0),
                "unique": int(len(unique)),
                "duplicates": int(len(ids) - len(unique)),
                "missing": int(len(np.setdiff1d(expected, unique))),
                "unexpected": int(len(np.setdiff1d(unique, expected))),
                "misplaced": misplaced.get(epoch, 0),
            }
        )
    return out


def audit_batches(snap: RunSnapshot) -> list[list[Any]]:
    """``[step, digest of its global batch]`` for every step the final model was trained on:
    two runs of one job (one killed and resized, one not) list the same."""
    return [[e.step, batch_digest(e.ids)] for e in _surviving_steps(snap)]


def _timing(snap: RunSnapshot, run_started: float | None) -> dict[str, float | None]:
    """Wall-clock times: the driver started (``run_started``: the origin of goodput's clock
    and the timeline's), the run ledger started (after the cluster), the first attempt's
    train function started on rank 0, the run's first step ended (and what that step took:
    its batch wait and the step), the run finished."""
    first = snap.first_step
    return {
        "run_started": snap.started if run_started is None else run_started,
        "started": snap.started,
        "workers_started": snap.attempts[0].started if snap.attempts else None,
        "first_step": first.time if first else None,
        "first_step_took": first.took if first else None,
        "finished": snap.finished,
    }


def summary_metrics(
    snap: RunSnapshot, failures: list[dict[str, Any]], storage: StorageStats
) -> dict[str, float]:
    """Every key of :data:`ftjob.metrics.METRIC_KEYS`: the workers' last reported values, and
    the figures only the whole run knows (restores, storage, failures, recovery)."""
    upload = storage.kind("upload")
    metrics = {key: 0.0 for key in M.METRIC_KEYS}
    metrics.update({k: v for k, v in snap.metrics.items() if k in metrics})
    recovered = [f for f in failures if f.get("time_to_recover_s") is not None]
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
            M.CHECKPOINT_RETRY_WAIT: storage.as_dict().get("upload", {}).get("retry_wait_s", 0.0),
            M.CHAOS_KILLS: len(snap.kills),
            M.FAILURES_COUNT: sum(1 for f in failures if f["kind"] != PREEMPTION),
            M.RECOVERY_TIME_TO_RECOVER: statistics.fmean(f["time_to_recover_s"] for f in recovered)
            if recovered
            else 0.0,
            M.RECOVERY_LOST_STEPS: sum(f.get("lost_steps", 0) for f in failures),
            **preemption_metrics(snap, failures),
            **hang_metrics(snap),
        }
    )
    return metrics


def declared_failures(config: dict[str, Any]) -> tuple[float | None, int | None]:
    """The failure rate a run declared, for the model: (mean seconds between failures, at
    most this many failures). A kill schedule: one per window, at most max_kills (at_steps:
    exactly that many); else failure.expected_mtbf_s."""
    chaos, failure = config.get("chaos") or {}, config.get("failure") or {}
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
    status: str,
    error: str | None,
    wall_time_s: float,
    config: dict[str, Any],
    driver_storage: StorageStats | None = None,
    run_started: float | None = None,
) -> dict[str, Any]:
    """``run_started``: when the driver started (the goodput clock; default: the ledger's
    start, which misses the driver's own start-up)."""
    failures = failure_records(snap)
    resizes = resize_records(snap, failures)
    storage = storage_totals(snap, driver_storage)
    metrics = summary_metrics(snap, failures, storage)
    most = snap.plan.num_workers
    ended = snap.started + wall_time_s if run_started is None else run_started + wall_time_s
    metrics[M.ELASTIC_RESIZES] = len(resizes)
    metrics[M.ELASTIC_TIME_BELOW_FULL] = time_below_full(snap.attempts, most, ended)
    first = snap.first_step
    accounted = goodput(
        wall_s=wall_time_s,
        run_started=snap.started if run_started is None else run_started,
        first_step=first.time if first else None,
        first_step_took=first.took if first else 0.0,
        finished=snap.finished,
        metrics=metrics,
        failures=failures,
        resizes=resizes,
    )
    metrics[M.GOODPUT_ETTR] = accounted["ettr"]
    steps = {c.step for c in snap.checkpoints}  # each checkpointed step once
    recovered = sum(1 for f in failures if f.get("recovered"))
    snapshots = int(metrics[M.CHECKPOINT_MEMORY_SNAPSHOTS])  # the memory tier's, if on
    failures_declared = declared_failures(config)
    predicted = predict_ettr(accounted, len(steps), recovered, *failures_declared, snapshots)
    accounted["predicted"] = predicted
    if predicted is not None:
        metrics[M.GOODPUT_PREDICTED_ETTR] = predicted["ettr"]
        metrics[M.CHECKPOINT_OPTIMAL_INTERVAL] = predicted["optimal_interval_s"] or 0.0
    return M.json_safe(
        {
            "name": name,
            "status": status,
            "error": error,
            "wall_time_s": wall_time_s,
            "metrics": metrics,
            **_records(snap, failures, storage, config),
            "world_sizes": [a.world_size for a in snap.attempts],
            "resizes": resizes,
            "timing": _timing(snap, run_started),
            "goodput": accounted,
        }
    )


def _records(
    snap: RunSnapshot, failures: list[dict[str, Any]], storage: StorageStats, config: Any
) -> dict[str, Any]:
    """The parts of summary.json that list what happened."""
    committed = snap.committed()
    fallbacks = [fb.to_json() for r in snap.restores() for fb in r.skipped]
    totals = storage.as_dict()
    all_ops = StorageStats()
    all_ops.kind("all")
    for stats in storage.by_kind.values():
        all_ops.kind("all").merge(stats)
    summary: dict[str, Any] = {
        "progress": snap.progress.to_json() if snap.progress is not None else {},
        # progress points, each step's surviving version
        "history": [h.to_json() for h in snap.history],
        "failures": failures,
        "chaos": {
            "kills": [k.to_json() for k in snap.kills],
            "skipped": [s.to_json() for s in snap.chaos_skipped],
            "injected": [e.to_json() for e in snap.injected],
        },
        "checkpoints": {
            "committed": len(committed),
            "failed": len(snap.checkpoints) - len(committed),
            "latest": committed[-1].path if committed else None,
            "fallbacks": fallbacks,  # checkpoints that did not verify, and where they went
        },
        "storage": {**totals, "total": all_ops.as_dict()["all"]},
        "validation": [v.to_json() for v in snap.validations],
        "validation_replaced": snap.replaced_validations,
        "attempts": len(snap.attempts),
        "hangs": [h.to_json() for h in snap.watch.hangs],
        "stragglers": snap.watch.stragglers.to_json(),
        "section_timeouts": {s: t.to_json() for s, t in snap.watch.sections.items()},
        "config": config,
    }
    summary["data"] = data_record(snap)
    if snap.audit:
        summary["audit"] = audit_report(snap)
        summary["audit_batches"] = audit_batches(snap)
    return summary


def data_record(snap: RunSnapshot) -> dict[str, Any]:
    """What the run's data held that is not a sample: the files skipped as bad
    (dataset.bad_files=skip), once each, with the split, catalog id, path and reason, and the
    attempt and rank that skipped it."""
    files = snap.skipped_files
    record: dict[str, Any] = {"skipped": len(files), "skipped_files": [f.to_json() for f in files]}
    record["decode"] = snap.decode.to_json() if snap.decode is not None else None
    return record


def write_summary(summary: dict[str, Any], run_dir: str) -> str:
    path = os.path.join(run_dir, SUMMARY_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, path)
    return path


def _event_lines(summary: dict[str, Any]) -> list[str]:
    """Resizes, hangs, stragglers and skipped chaos, one line each."""
    lines: list[str] = []
    for r in summary.get("resizes", []):
        ttr = r.get("time_to_recover_s")
        lines.append(
            f"  resize at attempt {r['attempt']}: {r['kind']} {r['from']} -> {r['to']} workers "
            f"({r['cause']}), lost {r['lost_steps']} steps"
            + (f", training again after {ttr:.1f}s" if ttr is not None else "")
        )
    for h in summary.get("hangs", []):
        lines.append(
            f"  hang: rank {h['rank']} in {h['section']} at step {h['step']}, found after "
            f"{h['stalled_for_s']:.1f}s without progress (timeout {h['timeout_s']:.0f}s); stack: "
            f"{h.get('stack_source') or 'not captured'}"
        )
    for s in (summary.get("stragglers") or {}).get("flagged", []):
        lines.append(
            f"  straggler: rank {s['rank']} {s['slowdown']:.2f}x slower than the fastest rank"
            + (" (restarted)" if s.get("restarted") else "")
        )
    for skip in (summary.get("chaos") or {}).get("skipped", []):
        lines.append(f"  chaos: no {skip.get('kind')} kill: {skip.get('reason')}")
    bad = (summary.get("data") or {}).get("skipped_files", [])
    if bad:
        lines.append(
            f"  data: {len(bad)} bad file(s) skipped (dataset.bad_files=skip; summary.json "
            "data.skipped_files):"
        )
        lines.extend(f"    {f.get('path')} ({f.get('reason')})" for f in bad[:20])
        lines.extend([f"    ... and {len(bad) - 20} more"] if len(bad) > 20 else [])
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    """The summary a person reads: at the end of a run, and from ``python -m ftjob.report``.
    Reads any summary.json, also one of a job that never started (figures then 0)."""
    m = dict.fromkeys(M.METRIC_KEYS, 0.0)
    m.update(summary.get("metrics") or {})
    error = summary.get("error")
    checkpoints = summary.get("checkpoints") or {}
    lines = [
        f"run {summary.get('name') or '?'}: {summary.get('status', 'failed')}, wall time "
        f"{float(summary.get('wall_time_s') or 0.0):.1f} s" + (f" -- {error}" if error else ""),
        f"  steps {fmt(m[M.TRAIN_STEPS_COMPLETED], '.0f')} ({fmt(m[M.TRAIN_STEP], '.1f')} s in them: "
        f"train/step), {fmt(m[M.TRAIN_GLOBAL_THROUGHPUT], '.0f')} img/s, "
        f"train loss {fmt(m[M.TRAIN_LOSS])}, validation accuracy {fmt(m[M.VALIDATION_ACCURACY])} "
        f"(loss {fmt(m[M.VALIDATION_LOSS])})",
        f"  checkpoints committed {checkpoints.get('committed', 0)}, upload retries "
        f"{fmt(m[M.CHECKPOINT_UPLOAD_RETRIES], '.0f')}, upload failures {fmt(m[M.CHECKPOINT_UPLOAD_FAILURES], '.0f')}",
        f"  kills {fmt(m[M.CHAOS_KILLS], '.0f')}, failures {fmt(m[M.FAILURES_COUNT], '.0f')}, mean time-to-recover "
        f"{fmt(m[M.RECOVERY_TIME_TO_RECOVER], '.1f')}s, restoration {fmt(m[M.CHECKPOINT_RESTORATION_TIME], '.2f')}s, "
        f"lost steps {fmt(m[M.RECOVERY_LOST_STEPS], '.0f')}",
    ]
    if done := summary.get("already_finished"):  # resume=auto of a finished run
        return _already_finished(lines[0], done.get("step"), done.get("checkpoint"))
    buckets = (summary.get("goodput") or {}).get("buckets") or {}
    if buckets:
        spent = ", ".join(f"{k} {v:.1f}" for k, v in buckets.items() if v >= 0.05 or v <= -0.05)
        lines.append(f"  goodput: ETTR {fmt(m[M.GOODPUT_ETTR], '.3f')}; seconds: {spent}")
    if m[M.PREEMPTION_COUNT]:
        lines.append(
            f"  preemptions {fmt(m[M.PREEMPTION_COUNT], '.0f')}: lost steps "
            f"{fmt(m[M.PREEMPTION_LOST_STEPS], '.0f')}, just-in-time checkpoints "
            f"{fmt(m[M.PREEMPTION_JIT_CHECKPOINT_TIME], '.2f')}s"
        )
    for f in summary.get("failures", []):
        parts = [f"  failure {f['attempt']}: {f['kind']}"]
        if f.get("time_to_recover_s") is not None:
            parts.append(
                f"detect {f['detection_s']:.1f}s, restart {f['restart_s']:.1f}s, download {f['download_s']:.2f}s, "
                f"load {f['load_s']:.2f}s, skip {f['skip_s']:.3f}s -> recovered in {f['time_to_recover_s']:.1f}s "
                f"(lost {f['lost_steps']} steps)"
            )
        else:
            parts.append("not recovered")
        lines.append(", ".join(parts))
    lines.extend(_event_lines(summary))
    for a in summary.get("audit", []):
        lines.append(
            f"  audit epoch {a['epoch']}: unique {a['unique']}, duplicates {a['duplicates']}, missing {a['missing']}"
        )
    return "\n".join(lines)


def _already_finished(head: str, step: object, checkpoint: object) -> str:
    """``resume=auto`` found the run finished: nothing was trained by this command, so no
    figures are printed -- zeros would read as a run that trained nothing."""
    return f"{head}\n  already finished at step {step} ({checkpoint}): this command trained nothing"


def write_failed_summary(
    run_dir: str,
    error: str,
    config: Any,
    snapshot: RunSnapshot,
    redactor: Any = None,
    status: str = "failed",
) -> str:
    """summary.json for a job that could not start (so a sweep still reports it): ``snapshot``
    is an empty run record; its config with the secrets ``redactor``
    (:class:`ftjob.config.secrets.Redactor`) knows redacted."""
    from omegaconf import OmegaConf

    plain: Any = (
        OmegaConf.to_container(config, resolve=False) if not isinstance(config, dict) else config
    )
    if redactor is not None:
        plain = redactor.config(plain)
    summary = build_summary(
        snapshot, name="", status=status, error=error, wall_time_s=0.0, config=plain
    )
    if redactor is not None:
        summary = redactor.strings(summary)
    return write_summary(summary, run_dir)
