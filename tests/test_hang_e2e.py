"""End-to-end: a stopped worker is found by its silence, its stack read and the group restarted;
a slow rank is named, a slow upload is not a hang. (The restart-loop guard is tested
in-process: test_worker_local.py.)"""

from __future__ import annotations

import pytest

from ftjob import metrics as M
from tests.helpers import run_ftjob

pytestmark = pytest.mark.ray


def test_a_stopped_worker_is_found_its_stack_read_and_the_run_recovers(tmp_path):
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "chaos=hang",
            "trainer.epochs=5",
            "chaos.at_steps=[40]",  # of 110
            "trainer.audit_samples=true",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert s["status"] == "succeeded"
    [stop] = s["chaos"]["kills"]
    assert stop["kind"] == "hang"
    [hang] = s["hangs"]
    assert hang["rank"] == stop["target"]["rank"] and hang["pid"] == stop["target"]["pid"]
    assert hang["heartbeats_stopped"] and hang["killed"]
    # Found by the default, learned timeouts within 30 s of the stop.
    assert hang["learned"] and hang["time"] - stop["time"] < 30.0
    assert hang["stack_source"] == "py-spy" and "ftjob/worker/loop.py" in hang["stack"]
    [failure] = s["failures"]
    assert failure["kind"] == "hang" and failure["recovered"]
    assert failure["detail"]["rank"] == hang["rank"]
    assert s["metrics"][M.HANG_COUNT] == 1
    assert 0 < s["metrics"][M.HANG_DETECTION_TIME] < 30.0
    assert all(a["duplicates"] == 0 and a["missing"] == 0 for a in s["audit"])
    assert "hang: rank" in proc.stdout and "stack captured (py-spy)" in proc.stdout
    assert "A worker died or was killed" not in proc.stdout  # Ray's paragraph stays in its logs


def test_a_slow_rank_is_named_and_a_slow_upload_is_no_hang(tmp_path):
    proc, s = run_ftjob(
        [
            "+experiment=digits_ft",
            "trainer.epochs=3",
            "trainer.checkpoint_every_n_steps=0",  # one checkpoint per epoch
            "chaos=slow",
            "chaos.interval=2",
            "chaos.slowdown=1.0",  # the slow rank takes twice its own step time
            "failure.straggler.patience=4",
            # Every section times out after 10 s without progress; a request may take 1.5 s.
            "failure.hang.timeout=10",
            "checkpoint.retry.deadline=1",
            "checkpoint.retry.max_backoff=0.5",
            "chaos.storage.upload_delay=2.5",  # 5 requests: a checkpoint takes > 12 s
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert s["status"] == "succeeded" and s["hangs"] == [] and s["failures"] == []
    [slow] = s["chaos"]["kills"]
    [straggler] = s["stragglers"]["flagged"]
    assert straggler["rank"] == slow["target"]["rank"]
    assert 1.5 < straggler["slowdown"] < 2.7, straggler  # injected: 2.0
    assert 1.5 < s["metrics"][M.STRAGGLER_MAX_SLOWDOWN] < 2.7
    assert f"straggler: rank {straggler['rank']} is" in proc.stdout
    # The checkpoints took longer than the timeout; each upload request moved them on.
    checkpoint = s["section_timeouts"]["checkpoint"]
    assert checkpoint["p99_s"] > 10.0 and checkpoint["timeout_s"] == 10.0
