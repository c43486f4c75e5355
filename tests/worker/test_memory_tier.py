"""The memory tier in whole jobs run in this process (world 1: the worker in the test's
process): snapshots copied while the next step trains, restored after failures, leave the
weights of the job without the tier; an optimizer that keeps no state snapshots as any other."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ftjob import metrics as M
from ftjob.memory.snapshot_copy import SnapshotCopy, Staged
from ftjob.memory.tier import MemoryTier
from ftjob.storage.checkpoint import checkpoint_file
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally

pytestmark = pytest.mark.worker

DIGITS = ("+experiment=digits_ft", "trainer.num_workers=1", "trainer.epochs=1")


def final_weights(run: Any) -> dict[str, torch.Tensor]:
    model = checkpoint_file(run.summary["checkpoints"]["latest"], "model.pt")
    return torch.load(io.BytesIO(model), weights_only=True)


def hold_copies_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every snapshot's copy of the live state begins as late as it may: once the training
    thread settles it before the next optimizer step (or, were it never settled, when the
    next snapshot is due -- after that step: the copy would hold the step after its own)."""
    gates: dict[int, threading.Event] = {}  # a copier's snapshot being held back
    layouts, settle = SnapshotCopy.layouts, SnapshotCopy.settle
    take, wait = MemoryTier.take, MemoryTier.wait

    def late_layouts(self: SnapshotCopy, staged: Staged) -> Any:
        assert gates[id(self)].wait(timeout=120), "a snapshot's copy was never let go"
        return layouts(self, staged)

    def settle_lets_go(self: SnapshotCopy) -> float:
        if self._pending:
            gates[id(self)].set()
        return settle(self)

    def take_lets_go(self: MemoryTier, *args: Any) -> None:
        if self.copier._pending:  # the last one was never settled
            gates[id(self.copier)].set()
        if self._idle.is_set():  # a snapshot begins (else it is skipped): held back
            gates[id(self.copier)] = threading.Event()
        take(self, *args)

    def wait_lets_go(self: MemoryTier, timeout: float | None = None) -> None:
        if id(self.copier) in gates:  # the attempt ends: no step comes to settle it
            gates[id(self.copier)].set()
        wait(self, timeout)

    monkeypatch.setattr(SnapshotCopy, "layouts", late_layouts)
    monkeypatch.setattr(SnapshotCopy, "settle", settle_lets_go)
    monkeypatch.setattr(MemoryTier, "take", take_lets_go)
    monkeypatch.setattr(MemoryTier, "wait", wait_lets_go)


def test_snapshots_copied_while_the_next_step_trains_restore_to_the_weights_of_a_run_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # digits_ft at world 1 (small_cnn: BatchNorm; AdamW), a snapshot due after every step,
    # durable checkpoints every 10: failures at steps 7 and 15 restore snapshots taken after
    # the last durable checkpoint, each copied while the step after it ran its forward and
    # backward passes. (Held back so, a snapshot is still being written when the next is due:
    # that one is skipped, so the newest held may be two steps back.)
    hold_copies_back(monkeypatch)
    on = ("checkpoint.memory.enabled=true", "chaos.fail_at_steps=[7,15]")
    run = run_locally(compose_job(*DIGITS, *on), tmp_path / "tier")
    s, m = run.summary, run.summary["metrics"]
    assert s["status"] == "succeeded", (s["error"], run.errors)
    assert [f["tier"] for f in s["failures"]] == ["memory", "memory"], s["failures"]
    first, second = (f["restored_step"] for f in s["failures"])
    assert 5 <= first <= 7 and 13 <= second <= 15, s["failures"]
    off = run_locally(compose_job(*DIGITS, "checkpoint.memory.enabled=false"), tmp_path / "no_tier")
    assert off.summary["status"] == "succeeded", off.errors
    expected, got = final_weights(off), final_weights(run)
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    # The steps waited for the copies (held back until then): the snapshots' time, not theirs.
    assert m[M.CHECKPOINT_MEMORY_SNAPSHOTS] > 10
    assert 0 < m[M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT] < m[M.CHECKPOINT_MEMORY_SNAPSHOT_TIME]


def test_an_optimizer_that_keeps_no_state_runs_with_the_tier_and_restores_from_it(
    tmp_path: Path,
):
    # SGD without momentum keeps no tensor: every snapshot failed, and every attempt with it,
    # until the failure budget was spent.
    job = compose_job(
        *DIGITS,
        "optimizer=sgd",
        "optimizer.momentum=0",
        "checkpoint.memory.enabled=true",
        "chaos.fail_at_steps=[15]",
    )
    run = run_locally(job, tmp_path)
    s = run.summary
    assert s["status"] == "succeeded", (s["error"], run.errors)
    [failure] = s["failures"]
    assert failure["tier"] == "memory" and failure["restored_step"] in (14, 15), failure
    assert s["metrics"][M.CHECKPOINT_MEMORY_SNAPSHOTS] > 30
