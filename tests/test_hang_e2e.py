"""End-to-end: a stopped worker is found by its silence, its stack read, the worker SIGKILLed and
the group restarted by Ray Train, every sample still trained once. (A slow rank named as a
straggler, a slow upload that is no hang, and the restart-loop guard are tested in-process:
test_worker_local.py; the hang and straggler decisions in test_hang.py.)"""

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
            "trainer.epochs=3",
            "chaos.at_steps=[30]",  # of 66
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
