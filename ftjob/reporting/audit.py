"""The sample audit (``trainer.audit_samples``): which samples the final model was trained on,
per epoch, against the data order -- exact-once, and each step on its own global batch."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ftjob.data.order import ShuffleWindows, epoch_order
from ftjob.record import AuditStep, RunSnapshot
from ftjob.reporting.run_summary import EpochAudit


def _surviving_steps(snap: RunSnapshot) -> list[AuditStep]:
    """The audited steps the final model was trained on: steps an attempt trained past the
    checkpoint the next attempt restored were thrown away with that attempt (lost work). A
    slice is sent as its step starts: the last attempt's step that never completed (the
    run ended inside it) is not the model's either."""
    # Where each attempt continued from; one that stopped at its start continued nothing,
    # and the steps before it stand until an attempt that did continue.
    restored = {a.index: s for a in snap.attempts if (s := a.continued_from) is not None}
    trained = {a.index: a.max_step for a in snap.attempts}
    kept = []
    for entry in snap.audit:
        a, step = entry.attempt, entry.step
        nxt = min((i for i in restored if i > a), default=None)
        upper = restored[nxt] if nxt is not None else trained.get(a, 0)
        if restored.get(a, 0) < step <= upper:
            kept.append(entry)
    return sorted(kept, key=lambda e: e.step)


def batch_digest(ids: Sequence[int]) -> str:
    """A global batch's identity, whatever the order its ranks sent their slices in."""
    return hashlib.sha256(np.sort(np.asarray(ids, dtype=np.int64)).tobytes()).hexdigest()[:16]


def audit_report(snap: RunSnapshot) -> tuple[EpochAudit, ...]:
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
            EpochAudit(
                epoch=epoch,
                resumed_at=start,
                trained=int(len(ids)) - skipped.get(epoch, 0),
                skipped=skipped.get(epoch, 0),
                unique=int(len(unique)),
                duplicates=int(len(ids) - len(unique)),
                missing=int(len(np.setdiff1d(expected, unique))),
                unexpected=int(len(np.setdiff1d(unique, expected))),
                misplaced=misplaced.get(epoch, 0),
            )
        )
    return tuple(out)


def audit_batches(snap: RunSnapshot) -> tuple[tuple[int, str], ...]:
    """``(step, digest of its global batch)`` for every step the final model was trained on:
    two runs of one job (one killed and resized, one not) list the same."""
    return tuple((e.step, batch_digest(e.ids)) for e in _surviving_steps(snap))
