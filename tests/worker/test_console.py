"""What the console says of a run, read as a newcomer reads it: the last progress line's loss
is that of its own steps (and is the train loss the summary reports), and a restore names the
epoch as the progress lines count it, from 1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftjob import metrics as M
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally

pytestmark = pytest.mark.worker

PROGRESS = re.compile(r"epoch (\d+)/\d+ step (\d+)/\d+ loss (\S+) ")
RESTORED = re.compile(r"restored step (\d+) \(epoch (\d+), sample (\d+)\)")


def test_the_last_progress_line_and_a_restore_say_what_happened(tmp_path: Path) -> None:
    # One worker at digits_ft's batch: 44 steps an epoch, a line every 10 steps and the last at
    # 44, whose 4 steps had a loss of their own; a failure at step 25 restores mid-epoch.
    job = compose_job(
        "+experiment=digits_ft",
        "trainer.num_workers=1",
        "trainer.epochs=1",
        "chaos.fail_at_steps=[25]",
    )
    run = run_locally(job, tmp_path)
    assert run.summary["status"] == "succeeded", run.errors
    lines = [(m, line) for line in run.lines if (m := PROGRESS.match(line))]
    (before, _), (last, _) = lines[-2], lines[-1]
    assert (before.group(2), last.group(2)) == ("40", "44")
    assert last.group(3) != before.group(3), lines[-2:]  # steps 41-44's loss, not 31-40's
    assert f"{run.summary['metrics'][M.TRAIN_LOSS]:.4f}" == last.group(3)
    # The restore's epoch is the one the progress lines around it name.
    [restored] = [m for line in run.lines if (m := RESTORED.match(line))]
    step = int(restored.group(1))
    after = next(m for m, _ in lines if int(m.group(2)) > step)
    assert 0 < step < 44 and restored.group(2) == after.group(1) == "1", run.lines
