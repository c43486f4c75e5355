"""Chaos on real Ray: node kills on a simulated 3-node cluster, an elastic shrink and grow.
Each run is a full training job; these are the slowest tests. (A worker process killed with
SIGKILL and recovered from is the hang test's stalled worker, test_hang_e2e.py; the killer's
choice of target is unit-tested in test_chaos.py; the failure budget and restores after
failures are tested in-process: test_worker_local.py.)"""

from __future__ import annotations

import pytest

from ftjob import metrics as M
from ftjob.reporting.summary import exactly_once
from tests.helpers import run_ftjob

pytestmark = pytest.mark.ray

JOB = ["+experiment=digits_ft", "trainer.epochs=4"]
# Kills at training steps (88 in all), not at times: every kill lands while there is training
# left to interrupt, however fast or slow this machine is.
EARLY_KILLS = ["chaos.at_steps=[20,50]"]


def test_node_kills_recover_within_budget_and_every_sample_is_trained_once(tmp_path):
    chaos = [
        "ray.local_nodes=3",
        "chaos=node_killer",
        *EARLY_KILLS,
        "failure.max_failures=4",
        "trainer.audit_samples=true",
    ]
    proc, s = run_ftjob([*JOB, *chaos], tmp_path / "killed")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    m = s["metrics"]
    assert s["status"] == "succeeded"
    assert m[M.CHAOS_KILLS] == 2 and len(s["chaos"]["kills"]) == 2
    assert all(k["kind"] == "node" and k["target"]["node_id"] for k in s["chaos"]["kills"])
    assert m[M.FAILURES_COUNT] >= 2 and len(s["failures"]) == m[M.FAILURES_COUNT]
    for f in s["failures"]:  # one recovery record per failure, each part measured
        assert f["recovered"] and f["kind"] == "node_kill"
        assert f["detection_s"] >= 0 and f["restart_s"] > 0 and f["time_to_recover_s"] > 0
        # Inside the new workers: every part of their start, within the time to recover.
        parts = ("process_group", "model", "first_batch", "first_step")
        assert all(f["phases"][p] > 0 for p in parts), f["phases"]
        assert sum(f["phases"][p] for p in parts) < f["time_to_recover_s"] - f["restart_s"]
    assert m[M.RECOVERY_TIME_TO_RECOVER] > 0 and m[M.CHECKPOINT_RESTORATION_TIME] > 0
    assert m[M.VALIDATION_ACCURACY] >= 0.85
    assert "chaos: kill 2" in proc.stdout and "[state-dump]" not in proc.stdout
    # Every step trained its global batch of the data order, each sample once.
    assert len(s["audit"]) == 4 and all(exactly_once(a) for a in s["audit"])


def test_an_elastic_run_continues_on_fewer_workers_and_grows_back_training_the_same_batches(
    tmp_path,
):
    """digits_elastic: a node (one of the two workers) is killed at step 20; training goes on
    at world size 1 until the node is back, then grows to 2 after a checkpoint of its step."""
    proc, s = run_ftjob(
        [
            "+experiment=digits_elastic",
            "trainer.epochs=6",
            "trainer.audit_samples=true",
            "ray.replace_delay=15",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert s["status"] == "succeeded"
    sizes = s["world_sizes"]
    assert sizes[0] == 2 and 1 in sizes and 2 in sizes[sizes.index(1) :], sizes
    shrink = next(r for r in s["resizes"] if r["kind"] == "shrink")
    grow = next(r for r in s["resizes"] if r["kind"] == "grow")
    assert (shrink["from"], shrink["to"], shrink["cause"]) == (2, 1, "failure")
    assert (grow["from"], grow["to"], grow["cause"], grow["lost_steps"]) == (1, 2, "planned", 0)
    assert grow["checkpoint"] and grow["time_to_recover_s"] > 0
    m = s["metrics"]
    assert m[M.ELASTIC_RESIZES] >= 2 and m[M.ELASTIC_TIME_BELOW_FULL] > 0
    assert m[M.FAILURES_COUNT] == 1  # the node kill; the grow is no failure
    assert "continuing on 1 of 2 workers" in proc.stdout
    # Every step trained the global batch the data order gives it (whatever the world size),
    # each sample once; and the model learned as an unresized run does.
    assert len(s["audit"]) == 6 and all(exactly_once(a) for a in s["audit"])
    assert m[M.VALIDATION_ACCURACY] >= 0.9
