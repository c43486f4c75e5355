"""Chaos on real Ray: node kills on a simulated 3-node cluster, worker kills, and the failure
budget. Each run is a full training job; these are the slowest tests."""

from __future__ import annotations

import pytest

from ftjob import metrics as M
from tests.conftest import run_ftjob

pytestmark = pytest.mark.ray

JOB = ["+experiment=digits_ft", "trainer.epochs=6"]
# Kills at training steps (132 in all), not at times: every kill lands while there is training
# left to interrupt, however fast or slow this machine is.
EARLY_KILLS = ["chaos.at_steps=[20,70]"]


def test_node_kills_recover_within_budget_and_match_an_unkilled_run(tmp_path):
    chaos = [
        "ray.local_nodes=3",
        "chaos=node_killer",
        *EARLY_KILLS,
        "failure.max_failures=4",
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
    assert m[M.RECOVERY_TIME_TO_RECOVER] > 0 and m[M.CHECKPOINT_RESTORATION_TIME] > 0
    assert m[M.VALIDATION_ACCURACY] >= 0.9
    assert "chaos: kill 2" in proc.stdout and "[state-dump]" not in proc.stdout

    calm, reference = run_ftjob(JOB, tmp_path / "calm")
    assert calm.returncode == 0 and reference["metrics"][M.CHAOS_KILLS] == 0
    assert abs(m[M.VALIDATION_ACCURACY] - reference["metrics"][M.VALIDATION_ACCURACY]) <= 0.02


def test_worker_kills_keep_every_sample_exactly_once(tmp_path):
    chaos = [
        "chaos=worker_killer",
        *EARLY_KILLS,
        "failure.max_failures=4",
    ]
    proc, s = run_ftjob([*JOB, *chaos, "trainer.audit_samples=true"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert s["metrics"][M.CHAOS_KILLS] == 2 and s["metrics"][M.FAILURES_COUNT] >= 2
    assert all(k["kind"] == "worker" and k["target"]["pid"] > 0 for k in s["chaos"]["kills"])
    assert [a["epoch"] for a in s["audit"]] == list(range(6))
    assert all(a["duplicates"] == 0 and a["missing"] == 0 for a in s["audit"])


def test_more_kills_than_the_budget_fail_cleanly(tmp_path):
    chaos = [
        "chaos=worker_killer",
        *EARLY_KILLS,
        "failure.max_failures=1",
    ]
    proc, s = run_ftjob([*JOB, *chaos], tmp_path)
    assert proc.returncode == 1
    assert s["status"] == "failed"
    assert "failure.max_failures=1" in s["error"] and "2 failure(s)" in s["error"]
    assert s["metrics"][M.CHAOS_KILLS] == 2
    assert s["failures"][-1]["recovered"] is False
    assert s["checkpoints"]["committed"] >= 1  # the last good checkpoint is still there
