"""The training worker in this process (no Ray): restores, exact-once, verdicts, notices.

Each test runs a whole job with :func:`tests.support.local_run.run_locally` -- the driver's real
preparation (storage, lease, resume checks), a real run ledger, real workers (world 2: two
processes in a gloo group) restarted after a failure the way Ray Train restarts them -- and
reads the summary that summary.json would hold. What only Ray can show stays in the ``ray``
end-to-end tests.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ftjob import metrics as M
from ftjob.record import Hang, Kill, KillTarget, RunSnapshot
from ftjob.storage.checkpoint import checkpoint_file
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally, stop_when
from tests.support.summaries import exactly_once

pytestmark = pytest.mark.worker


def run_digits(tmp_path: Path, *overrides: str, during: Any = None, **options: Any) -> Any:
    """digits_ft (1408 training samples: 22 steps of 64 an epoch) with ``overrides``, run
    in-process to its end: the :class:`~tests.support.local_run.LocalRun` (``options``:
    :func:`~tests.support.local_run.run_locally`'s)."""
    job = compose_job("+experiment=digits_ft", *overrides)
    return run_locally(job, tmp_path, during=during, **options)


def test_failures_restore_mid_epoch_and_every_sample_is_trained_once(tmp_path: Path):
    # Step 25 fails mid-epoch (last checkpoint: 22, the end of epoch 1); step 41 right after
    # the checkpoint of step 40. Two ranks in a gloo group, restarted as a group.
    run = run_digits(
        tmp_path,
        "trainer.epochs=2",
        "chaos.fail_at_steps=[25,41]",
        "trainer.audit_samples=true",
        "checkpoint.memory.enabled=false",  # restores from storage (the tier's: below)
    )
    s, m = run.summary, run.summary["metrics"]
    assert s["status"] == "succeeded" and s["error"] is None, run.errors
    assert set(M.METRIC_KEYS) <= set(m)
    assert m[M.TRAIN_STEPS_COMPLETED] == 2 * 22 and m[M.FAILURES_COUNT] == 2
    assert m[M.VALIDATION_ACCURACY] >= 0.85
    assert m[M.CHECKPOINT_DOWNLOAD] > 0 and m[M.CHECKPOINT_LOAD] > 0
    first, second = s["failures"]
    assert (first["kind"], first["restored_step"], first["lost_steps"]) == ("injected", 22, 3)
    assert (second["restored_step"], second["lost_steps"]) == (40, 1)
    # Each progress line counts the whole job's steps, so its ETA is the job's, from epoch 1 on.
    progress = [line for line in run.lines if re.match(r"epoch \d/2 step \d+/", line)]
    assert progress and all(re.search(r" step \d+/44 .*\| ETA \d+:\d\d", p) for p in progress)
    for f in s["failures"]:  # each restore measured in its parts; skipping reads no data
        assert f["recovered"] and f["time_to_recover_s"] > 0
        assert f["download_s"] > 0 and f["load_s"] > 0 and 0 <= f["skip_s"] < 1.0
        assert f["tier"] == "storage"
    # Validation results after a restore replace the lost attempt's, never duplicate them.
    steps = [v["step"] for v in s["validation"]]
    assert steps == sorted(set(steps)) and 40 in steps and steps[-1] == 44
    assert [a["epoch"] for a in s["audit"]] == [0, 1]
    assert all(exactly_once(a) and a["unique"] == 1408 for a in s["audit"])
    t = s["timing"]  # the first attempt's train function started before its first step
    assert t["started"] <= t["workers_started"] < t["first_step"] < t["finished"]


def test_the_ledger_holds_each_steps_slice_before_the_steps_gradients_are_summed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A slice sent after its step was lost with a rank killed between the step's all-reduce
    # and its report, while the step survived in the other rank's memory snapshot: the audit
    # then missed half a step the final model was trained on (a run judged failed for it).
    from ftjob.driver.ledger import RunLedger
    from ftjob.worker.heartbeat import Heartbeat

    audited: list[int] = []
    at_backward: list[int] = []
    record, straggle = RunLedger.audit_step, Heartbeat.straggle

    def audit_step(self: RunLedger, attempt: int, step: int, *rest: Any) -> None:
        audited.append(step)
        record(self, attempt, step, *rest)

    def before_backward(self: Heartbeat) -> None:
        at_backward.append(audited[-1] if audited else 0)
        straggle(self)

    monkeypatch.setattr(RunLedger, "audit_step", audit_step)
    monkeypatch.setattr(Heartbeat, "straggle", before_backward)
    run = run_digits(
        tmp_path, "trainer.epochs=1", "trainer.num_workers=1", "trainer.audit_samples=true"
    )
    assert run.summary["status"] == "succeeded", run.errors
    steps = run.summary["metrics"][M.TRAIN_STEPS_COMPLETED]
    assert steps >= 22 and at_backward == list(range(1, int(steps) + 1)) and audited == at_backward


def final_weights(run: Any) -> dict[str, torch.Tensor]:
    model = checkpoint_file(run.summary["checkpoints"]["latest"], "model.pt")
    return torch.load(io.BytesIO(model), weights_only=True)


def test_with_the_memory_tier_a_failure_loses_one_step_and_the_weights_match_an_unkilled_run(
    tmp_path: Path,
):
    # A snapshot after every step, in memory; durable checkpoints every 10 steps. Steps 15
    # and 37 fail on the rank that claims the failure, once the step is trained: restored from
    # the snapshots of 14 and 36 (storage has 10 and 30), or of 15 and 37 where rank 0 had its
    # snapshot of the step held before the group ended. Each rank stands for a node of its own,
    # with its own holder, which that node's rank writes; rank 0's own part of each snapshot
    # (BatchNorm statistics, records) reaches the other node's holder.
    common = ("trainer.epochs=2", "checkpoint.memory.enabled=true", "trainer.audit_samples=true")
    run = run_digits(
        tmp_path / "failed", *common, "chaos.fail_at_steps=[15,37]", node_per_rank=True
    )
    s, m = run.summary, run.summary["metrics"]
    assert s["status"] == "succeeded", (s["error"], run.errors)
    first, second = s["failures"]
    for failure, step in ((first, 15), (second, 37)):
        restored = failure["restored_step"]
        assert restored in (step - 1, step) and failure["tier"] == "memory", failure
        assert failure["lost_steps"] == step - restored
        assert failure["holder"] == "local"  # rank 0's own node's copy
        assert failure["checkpoint"] == f"memory:step_{restored:09d}"
    assert first["load_s"] > 0
    assert m[M.CHECKPOINT_MEMORY_RESTORES] == 2 and m[M.CHECKPOINT_MEMORY_SNAPSHOTS] > 30
    assert m[M.CHECKPOINT_MEMORY_SNAPSHOT_TIME] > 0
    # Rank 0 and the holder (the manager's process) share a machine: the snapshots went into
    # the holder's shared memory, no call each; the restores read them there.
    shared = "memory tier: snapshots go into the holder's shared memory (this machine)"
    assert run.lines.count(shared) == 3, run.lines  # once an attempt
    assert all(exactly_once(a) for a in s["audit"])
    # The final checkpoint is a durable one, as always; its weights are bit for bit those of
    # the same job without failures.
    assert s["checkpoints"]["latest"].endswith("step_000000044")
    clean = run_digits(tmp_path / "clean", *common)
    assert clean.summary["metrics"][M.CHECKPOINT_MEMORY_RESTORES] == 0
    expected, got = final_weights(clean), final_weights(run)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_memory_snapshots_every_auto_steps_pick_their_interval_from_the_measured_cost(
    tmp_path: Path,
):
    # 10 steps at world 1 on small generated images: the probe snapshot 5 steps in opens the
    # holder's memory (set-up, not a snapshot's cost), so the next step's probe measures the
    # cost. A share of step time far below that cost makes the interval longer than the run:
    # the two probes are the only snapshots.
    run = run_digits(
        tmp_path,
        "trainer.num_workers=1",
        "trainer.epochs=1",
        "dataset=synthetic",
        "dataset.num_samples=320",
        "dataset.num_val_samples=64",
        "dataset.image_size=16",
        "trainer.checkpoint_every_n_steps=0",  # durable: the end of the epoch only
        "checkpoint.memory.enabled=true",
        "checkpoint.memory.every_n_steps=auto",
        "checkpoint.memory.max_overhead=0.000001",
    )
    s, m = run.summary, run.summary["metrics"]
    assert s["status"] == "succeeded", (s["error"], run.errors)
    assert m[M.TRAIN_STEPS_COMPLETED] == 10
    chosen = [line for line in run.lines if line.startswith("memory snapshot interval (auto)")]
    assert len(chosen) == 1, run.lines  # said once, when chosen
    found = re.search(
        r"every (\d+) steps, for a snapshot cost of ([\d.]+) ms and ([\d.]+) ms", chosen[0]
    )
    assert found is not None, chosen
    interval, cost_ms, step_ms = int(found[1]), float(found[2]), float(found[3])
    # cost / (1e-6 of a step): about a million times the cost-to-step ratio
    assert cost_ms > 0 and step_ms > 0 and interval >= 0.8e6 * cost_ms / step_ms > 10
    assert m[M.CHECKPOINT_MEMORY_SNAPSHOTS] == 2 and m[M.CHECKPOINT_MEMORY_SNAPSHOT_TIME] > 0


def test_a_diverged_run_stops_as_failed_and_is_not_retried(tmp_path: Path):
    run = run_digits(tmp_path, "trainer.epochs=2", "optimizer=sgd", "trainer.lr=1e12")
    s = run.summary
    assert s["status"] == "failed"
    assert s["error"].startswith("training diverged: the loss became non-finite (nan) by step 10")
    assert s["metrics"][M.TRAIN_LOSS] is None  # null, never 0
    assert s["metrics"][M.FAILURES_COUNT] == 0 and s["attempts"] == 1  # not retried
    assert s["checkpoints"]["committed"] == 0  # no diverged weights were written


def test_async_uploads_failing_past_the_budget_end_the_run_on_every_rank(tmp_path: Path):
    run = run_digits(
        tmp_path,
        "trainer.epochs=2",
        "checkpoint.upload_mode=async",
        "checkpoint.max_consecutive_upload_failures=1",
        "chaos.storage.errors=[permanent]",  # denied checkpoint uploads, nothing else
        "chaos.storage.failure_rate=0.5",
        "checkpoint.retry.max_attempts=1",
    )
    s = run.summary
    assert s["status"] == "failed", run.errors
    assert "checkpoint upload(s) in a row failed" in s["error"]
    assert "checkpoint.max_consecutive_upload_failures=1" in s["error"]
    # Both ranks returned together (rank 0 broadcast the decision): no rank failed, no retry.
    assert run.errors == [] and s["failures"] == [] and s["attempts"] == 1
    assert s["checkpoints"]["failed"] >= 2
    assert s["metrics"][M.CHECKPOINT_UPLOAD_FAILURES] >= 2


def test_a_job_whose_every_attempt_fails_at_step_0_stops_as_a_restart_loop(tmp_path: Path):
    # One input channel for three-channel images: the first forward fails, on every attempt.
    run = run_digits(
        tmp_path, "trainer.num_workers=1", "+model.in_channels=1", "failure.restart_loop.attempts=2"
    )
    s = run.summary
    assert s["status"] == "failed"
    assert s["error"].startswith("restart loop: 2 attempts in a row failed before training")
    assert s["attempts"] == 3 and len(s["failures"]) == 2  # of a budget of 4
    assert "expected input" in s["failures"][0]["error"]


def test_more_failures_than_the_budget_fail_and_keep_the_last_good_checkpoint(tmp_path: Path):
    run = run_digits(
        tmp_path,
        "trainer.epochs=2",
        "trainer.num_workers=1",
        "chaos.fail_at_steps=[15,25]",
        "failure.max_failures=1",
    )
    s = run.summary
    assert s["status"] == "failed"
    assert "failure.max_failures=1" in s["error"] and "2 failure(s)" in s["error"]
    assert s["failures"][-1]["recovered"] is False
    assert s["checkpoints"]["committed"] >= 1  # the last good checkpoint is still there


def test_a_run_resumed_by_name_on_fewer_workers_continues_exactly(tmp_path: Path):
    storage = tmp_path / "store"
    common = ("trainer.epochs=2", "name=shared", f"checkpoint.storage_path={storage}")
    first = run_digits(
        tmp_path / "a", *common, "chaos.fail_at_steps=[17]", "failure.max_failures=0"
    )
    assert first.summary["status"] == "failed"
    assert "failure.max_failures=0" in first.summary["error"]
    # Same global batch (1 x 64 instead of 2 x 32): resumes right after sample 10 x 64.
    run = run_digits(
        tmp_path / "b",
        *common,
        "resume=true",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "trainer.audit_samples=true",
    )
    s = run.summary
    assert s["status"] == "succeeded", run.errors
    epoch0, epoch1 = s["audit"]
    assert epoch0["duplicates"] == 0 and epoch0["unexpected"] == 0
    # The first 10 x 64 samples of epoch 0 were trained by the first run: not expected again.
    assert epoch0["resumed_at"] == 10 * 64
    assert epoch0["unique"] == 12 * 64 and epoch0["missing"] == 0
    assert epoch1["unique"] == 1408 and epoch1["missing"] == 0 and epoch1["duplicates"] == 0


def test_a_stop_during_an_upload_makes_that_upload_the_just_in_time_checkpoint(tmp_path: Path):
    # Every upload request takes 0.5 s (a checkpoint: seconds); the stop comes while the
    # checkpoint of step 20 uploads.
    overrides = ("trainer.epochs=2", "trainer.num_workers=1", "chaos.storage.upload_delay=0.5")

    def uploading_step_20(snap: RunSnapshot) -> bool:
        return any(a.max_step >= 20 for a in snap.attempts)

    run = run_digits(tmp_path, *overrides, during=stop_when(uploading_step_20))
    s = run.summary
    assert s["status"] == "preempted", (s["error"], run.errors)
    [notice] = [a.preemption for a in run.snapshot.attempts if a.preemption]
    assert notice.source == "driver" and notice.step == 20
    assert notice.jit and notice.jit.reused and notice.jit.step == 20  # the upload in flight
    assert s["checkpoints"]["latest"].endswith("step_000000020")
    assert s["error"].endswith("after a just-in-time checkpoint of step 20")


def test_a_validation_cut_short_by_a_stop_runs_again_after_the_resume(tmp_path: Path):
    # Validation generates and scores 3000 small images at every epoch end (seconds in this
    # process); the stop comes once step 22 (the end of epoch 1) is trained, seen within a
    # heartbeat (about a second): during its validation, which the notice cuts short. The just-in-time checkpoint says so, and the resume validates step 22 before
    # it trains on.
    storage = tmp_path / "store"
    common = (
        "dataset=synthetic",
        "dataset.num_samples=1408",  # 22 steps of 64 an epoch, as digits
        "dataset.num_val_samples=3000",
        "dataset.image_size=32",
        "dataset.num_classes=10",
        "trainer.validation_cache_mb=0",
        "trainer.validate_every_n_steps=0",  # at epoch ends only
        "trainer.epochs=2",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "name=cut",
        f"checkpoint.storage_path={storage}",
    )

    def validating_step_22(snap: RunSnapshot) -> bool:
        return any(a.max_step >= 22 for a in snap.attempts)

    first = run_digits(tmp_path / "a", *common, during=stop_when(validating_step_22))
    assert first.summary["status"] == "preempted", (first.summary["error"], first.errors)
    [notice] = [a.preemption for a in first.snapshot.attempts if a.preemption]
    assert notice.step == 22 and notice.validation_cut == 22, notice
    assert notice.jit and notice.jit.step == 22 and notice.jit.path
    assert first.summary["validation"] == []  # nothing half-done is reported

    run = run_digits(tmp_path / "b", *common, "resume=true")
    s = run.summary
    assert s["status"] == "succeeded", (s["error"], run.errors)
    assert [v["step"] for v in s["validation"]] == [22, 44]  # 22 again, first


def test_a_slow_rank_is_named_a_straggler_and_a_slow_upload_is_no_hang(tmp_path: Path):
    # From step 5 rank 1 sleeps its own step time in every step (chaos=slow's doing, steered
    # through its heartbeat). Every section times out after 10 s without progress (set-up
    # alone takes ~5 s on a loaded 2-core machine), and each checkpoint upload takes > 12 s (5
    # requests of 2.5 s): only the requests' progress keeps the upload from being a hang.
    def slow_rank_1(ledger: Any) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            snap = ledger.snapshot.remote()
            if any(a.max_step >= 5 for a in snap.attempts):
                target = KillTarget("local", rank=1, pid=0)
                ledger.kill.remote(Kill(time.time(), "slow", target, attempt=0, slowdown=1.0))
                return
            time.sleep(0.1)

    run = run_digits(
        tmp_path,
        # 83 slow steps: room for the streak even where a loaded machine's noise breaks one
        # (each check scores the last 20 steps of each rank: rank 0's own can swell too)
        "trainer.epochs=4",
        "trainer.checkpoint_every_n_steps=0",  # one checkpoint an epoch
        "failure.straggler.patience=4",
        "failure.hang.timeout=10",
        "checkpoint.retry.deadline=1",
        "checkpoint.retry.max_backoff=0.5",
        "chaos.storage.upload_delay=2.5",
        during=slow_rank_1,
    )
    s = run.summary
    assert s["status"] == "succeeded" and s["hangs"] == [] and s["failures"] == [], run.errors
    [straggler] = s["stragglers"]["flagged"]
    assert straggler["rank"] == 1 and 1.5 < straggler["slowdown"] < 2.7, straggler  # 2.0
    assert 1.5 < s["metrics"][M.STRAGGLER_MAX_SLOWDOWN] < 2.7
    assert not any(isinstance(a, Hang) for a in run.watch_actions)
    # The checkpoints took longer than the timeout; each upload request moved them on.
    checkpoint = s["section_timeouts"]["checkpoint"]
    assert checkpoint["p99_s"] > 10.0 and checkpoint["timeout_s"] == 10.0
