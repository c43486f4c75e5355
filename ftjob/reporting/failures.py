"""Failure records: one per failure a run recovered from or died of -- where it came from and
what each part of the recovery cost -- read from the run ledger's snapshot (pure functions)."""

from __future__ import annotations

from typing import Any

from ftjob import metrics as M
from ftjob.reporting.resizes import ended_by_resize

PREEMPTION = "preemption"  # the kind of a failure record that a notice came before
NOT_FAILURES = ("hang", "slow")  # chaos that causes no failure itself (a hang is found, then ended)


def _recovery_events(snap: dict[str, Any]) -> list[dict[str, Any]]:
    kills = [
        {
            "time": k.get("deadline", k["time"]),  # a preempted node goes at its deadline
            "kind": PREEMPTION if k["kind"] == "preempt" else f"{k['kind']}_kill",
            "detail": k.get("target"),
        }
        for k in snap["kills"]
        if k["kind"] not in NOT_FAILURES
    ]
    hangs = [  # a hang that ftjob ended (its worker killed) is the failure's origin
        {"time": h["stalled_since"], "kind": "hang", "detail": h}
        for h in snap.get("hangs", [])
        if h.get("killed")
    ]
    restarted = [
        {"time": s["time"], "kind": "straggler", "detail": s}
        for s in snap.get("stragglers", {}).get("flagged", [])
        if s.get("restarted")
    ]
    injected = [
        {"time": e["time"], "kind": "injected", "detail": {"step": e["step"]}}
        for e in snap["injected"]
    ]
    return sorted(kills + injected + hangs + restarted, key=lambda e: e["time"])


def _start_phases(
    snap: dict[str, Any], attempt: int, first: dict[str, Any] | None
) -> dict[str, float]:
    """Inside an attempt's new workers (rank 0): set-up, restore, warm-up (its heartbeat
    sections), and their parts (process group, model; first batch, first step)."""
    return {**snap.get("phases", {}).get(str(attempt), {}), **(first or {}).get("phases", {})}


def failure_records(snap: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per failure: where it came from and how long each part of recovery took.

    Failure ``k`` ends the ``k``-th attempt not ended by a planned (elastic) resize; the next
    attempt is its recovery. Times: detection (origin -> Ray Train noticed), restart (noticed
    -> new worker group in the train function), download/load/skip (restore), time_to_recover
    (origin -> first trained step). The origin: the chaos kill or injected failure behind it,
    else the moment noticed."""
    attempts = snap["attempts"]
    noticed = sorted(f["noticed"] for f in snap["failures"])
    errors = [f["errors"] for f in sorted(snap["failures"], key=lambda f: f["noticed"])]
    events, planned = _recovery_events(snap), ended_by_resize(snap)
    failed = [a["index"] for a in attempts[:-1] if a["index"] not in planned]
    records = []
    for k in range(max(len(failed), len(noticed))):
        # Past the attempts followed by another: the last one, which died.
        i = failed[k] if k < len(failed) else len(attempts) - 1 + (k - len(failed))
        # (No attempt at all when every worker died before it could start one.)
        attempt = attempts[i] if 0 <= i < len(attempts) else None
        nxt = attempts[i + 1] if 0 <= i + 1 < len(attempts) else None
        notice = noticed[k] if k < len(noticed) else (nxt["started"] if nxt else None)
        lo = attempt["started"] if attempt else 0.0
        hi = notice if notice is not None else float("inf")
        cause = [e for e in events if lo <= e["time"] <= hi]
        origin = cause[-1] if cause else None
        t0 = origin["time"] if origin else notice
        record: dict[str, Any] = {
            "attempt": i + 1,
            "time": t0,
            "kind": origin["kind"] if origin else "error",
            "detail": origin["detail"] if origin else None,
            "error": next(iter(errors[k].values()), None) if k < len(errors) else None,
            "detection_s": (notice - t0) if notice is not None and t0 is not None else None,
            "recovered": False,
        }
        if nxt is not None:
            restored, first = nxt["restored"] or {}, nxt["first_step"]
            restored_step = restored.get("step", 0)
            parts = {f"{part}_s": restored.get(part, 0.0) for part in ("download", "load", "skip")}
            record.update(
                {
                    "restart_s": nxt["started"] - notice if notice is not None else None,
                    "restored_step": restored_step,
                    "checkpoint": restored.get("path"),
                    "tier": restored.get("tier", "storage") if restored else None,  # or "memory"
                    "fallbacks": restored.get("skipped", []),
                    **parts,
                    "restoration_s": sum(parts.values()),
                    "lost_steps": max(0, (attempt["max_step"] if attempt else 0) - restored_step),
                    "recovered": first is not None,
                    "first_step_s": (first or {}).get("took", 0.0),
                    "time_to_recover_s": (first["time"] - t0) if first and t0 is not None else None,
                }
            )
            record["phases"] = _start_phases(snap, i + 1, first)
            record["lost_window_s"] = _lost_window(snap, attempt, restored_step, t0)
        if attempt is not None and attempt.get("preemption"):
            _as_preemption(record, attempt["preemption"], nxt)
        records.append(record)
    return records


def _lost_window(
    snap: dict[str, Any], attempt: dict[str, Any] | None, restored_step: int, t0: float | None
) -> float | None:
    """The failed attempt's wall clock from the state the restore went back to (its start, or
    the restored checkpoint's upload when that attempt made it) to the failure's origin: the
    most the lost steps can have taken. Steps a dying worker still trained after the origin
    (a killed node's workers outlive their raylet by a moment) are in the detection time."""
    if attempt is None or t0 is None:
        return None
    since = attempt["started"]
    for c in snap["checkpoints"]:
        if c.get("path") and c["step"] == restored_step and c.get("time") is not None:
            since = max(since, c["time"] - (c.get("seconds") or 0.0))
    return max(0.0, t0 - since)


def _as_preemption(
    record: dict[str, Any], preemption: dict[str, Any], nxt: dict[str, Any] | None
) -> None:
    """A notice came first: the attempt ended by preemption, whatever took it down. Its clock
    starts when the node went (the deadline; without one, when the notice came): detection is
    0 (the notice came in advance), restart runs from then to the new worker group."""
    notice = dict(preemption)
    t0 = notice.get("deadline") or notice["received"]
    record.update(kind=PREEMPTION, time=t0, detection_s=0.0, jit=notice.pop("jit", None))
    record["notice"] = notice
    if nxt is not None:
        record["restart_s"] = nxt["started"] - t0
        if nxt["first_step"] is not None:
            record["time_to_recover_s"] = nxt["first_step"]["time"] - t0


def preemption_metrics(snap: dict[str, Any], failures: list[dict[str, Any]]) -> dict[str, float]:
    noticed = [a["preemption"] for a in snap["attempts"] if a.get("preemption")]
    preempted = [f for f in failures if f["kind"] == PREEMPTION]
    return {
        M.PREEMPTION_COUNT: len(noticed),
        M.PREEMPTION_LOST_STEPS: sum(f.get("lost_steps", 0) for f in preempted),
        M.PREEMPTION_JIT_CHECKPOINT_TIME: sum(
            (n.get("jit") or {}).get("seconds", 0.0) for n in noticed
        ),
    }


def hang_metrics(snap: dict[str, Any]) -> dict[str, float]:
    hangs = snap.get("hangs", [])
    return {
        M.HANG_COUNT: len(hangs),
        M.HANG_DETECTION_TIME: sum(h["stalled_for_s"] for h in hangs) / len(hangs)
        if hangs
        else 0.0,
        M.STRAGGLER_MAX_SLOWDOWN: snap.get("stragglers", {}).get("max_slowdown", 0.0),
    }
