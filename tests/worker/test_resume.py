"""resume=true in a whole job in this process (tests/support/local_run.py): a finished run resumed
with fewer epochs is refused before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftjob.driver.resume import (
    ResumeError,
)
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally


@pytest.mark.worker
def test_a_finished_run_resumed_with_fewer_epochs_is_refused_before_training(tmp_path: Path):
    common = ("+experiment=digits_ft", "name=done", f"checkpoint.storage_path={tmp_path / 's'}")
    one = ("trainer.num_workers=1", "trainer.batch_size=64", "chaos=disabled")
    first = run_locally(compose_job(*common, *one, "trainer.epochs=2"), tmp_path / "a")
    assert first.summary["status"] == "succeeded", first.errors
    with pytest.raises(
        ResumeError, match="has nothing left to train: its checkpoint is at step 44"
    ):
        run_locally(compose_job(*common, *one, "trainer.epochs=1", "resume=true"), tmp_path / "b")
