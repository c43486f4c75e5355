"""What an elastic run's resizes were (records, time below full size, progress words).

The global batch is ``trainer.batch_size x trainer.num_workers`` at every world size. With
``W`` workers each rank trains ``global / W`` samples of every global batch (the iterator's
slice), in micro-batches of at most ``batch_size``, accumulating gradients; the loss of each
micro-batch is weighted by its share of the rank's slice, so the gradient all-reduced across
ranks is the global batch's mean, as at full size. Data order, learning-rate schedule and
checkpoint position do not depend on ``W``: a resize changes which process trains a sample,
never which samples a step trains (:mod:`ftjob.policy.elastic`). How the group is resized is
in ``ftjob.driver.scaling``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ftjob.record import Attempt, RunSnapshot
from ftjob.reporting.run_summary import FailureRecord, PlannedResize, ResizeRecord


def describe_restart(before: int | None, world: int | None, most: int | None) -> str:
    """The progress line's words for a new worker group."""
    if world is None or before is None or most is None:
        return "training workers restarted"
    if world == before:
        line = "training workers restarted"
    else:
        line = f"worker group {'grown' if world > before else 'shrunk'} from {before} to {world}"
    if world < most:
        line += f"; continuing on {world} of {most} workers"
    return line


def ended_by_resize(snap: RunSnapshot) -> set[int]:
    """Indexes of the attempts a planned resize ended: the scaling policy carried one out
    while the attempt ran (``executed_resizes``), and no failure was noticed in it."""
    attempts, done = snap.attempts, snap.executed_resizes
    noticed = [f.noticed for f in snap.failures]
    ended = set()
    for a, nxt in zip(attempts, attempts[1:], strict=False):
        lo, hi = a.started, nxt.started
        if any(lo <= t < hi for t in done) and not any(lo <= t < hi for t in noticed):
            ended.add(a.index)
    return ended


def resize_records(
    snap: RunSnapshot, failures: tuple[FailureRecord, ...]
) -> tuple[ResizeRecord, ...]:
    """One record per change of world size between attempts: a shrink or grow after a
    failure (Ray Train restarted the group on what it could place), or a planned resize (the
    group was running when capacity changed; it committed a checkpoint of its step first,
    unless the workers did not agree in time). ``failures`` are the run's failure records
    (their clock: the failure's origin)."""
    attempts, planned = snap.attempts, ended_by_resize(snap)
    done = snap.executed_resizes
    by_attempt = {f.attempt: f for f in failures}
    records = []
    for prev, nxt in zip(attempts, attempts[1:], strict=False):
        before, after = prev.world_size, nxt.world_size
        if before is None or after is None or before == after:
            continue
        restored = nxt.restored.step if nxt.restored else 0
        t0: float | None
        part = None
        if prev.index in planned:
            notice = prev.resize  # none: the workers did not agree in time
            executed = [t for t in done if prev.started <= t < nxt.started]
            t0 = notice.received if notice else (executed[0] if executed else None)
            part = PlannedResize(notice.jit.path if notice and notice.jit else None)
        else:
            failure = by_attempt.get(prev.index + 1)
            t0 = failure.time if failure is not None else None
        first = nxt.first_step
        records.append(
            ResizeRecord(
                attempt=nxt.index + 1,
                kind="grow" if after > before else "shrink",
                from_=before,
                to=after,
                cause="planned" if prev.index in planned else "failure",
                lost_steps=max(0, prev.max_step - restored),
                planned=part,
                time=t0,  # when it began: the notice to resize, or the failure
                time_to_recover_s=first.time - t0 if first and t0 is not None else None,
                first_step_s=first.took if first else 0.0,
            )
        )
    return tuple(records)


def time_below_full(attempts: Sequence[Attempt], most: int | None, ended: float) -> float:
    """Seconds the run trained on fewer workers than ``trainer.num_workers``: attempts below
    full size, from their start to the next attempt's (or the run's end)."""
    if most is None:
        return 0.0
    total = 0.0
    for i, attempt in enumerate(attempts):
        world = attempt.world_size
        if world is not None and world < most:
            end = attempts[i + 1].started if i + 1 < len(attempts) else ended
            total += max(0.0, end - attempt.started)
    return total
