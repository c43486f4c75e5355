"""The summary printed at a run's end says what this command did: a rerun of a finished run
(``resume=auto``) trained nothing and prints no figures, and a run that trained prints its
``train/step`` as what it is -- seconds in its steps, not a count of them."""

from __future__ import annotations

import re
from pathlib import Path

from ftjob.driver import runner
from ftjob.reporting.run_summary import RunSummary
from ftjob.reporting.summary import format_summary
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally
from tests.unit.driver.test_resume import finished_digits_run


def test_a_finished_run_rerun_prints_that_it_was_finished_and_no_figures(tmp_path: Path) -> None:
    said: list[str] = []
    rerun = finished_digits_run(tmp_path, "resume=auto")
    result = runner.run(rerun, str(tmp_path / "rerun"), echo=said.append)
    assert result.ok
    summary = said[said.index(next(line for line in said if line.startswith("run done: "))) :]
    assert summary[0].startswith("run done: succeeded, wall time ")
    assert summary[1].startswith("  already finished at step 44 (") and summary[1].endswith(
        "): this command trained nothing"
    )
    assert not [line for line in said if "steps 0" in line or "accuracy" in line], said


def test_train_step_is_printed_as_the_seconds_it_is(tmp_path: Path) -> None:
    job = compose_job("+experiment=digits_ft", "trainer.num_workers=1", "trainer.epochs=1")
    run = run_locally(job, tmp_path)
    printed = format_summary(RunSummary.from_json(run.summary))
    shown = re.search(r"  steps 44 \((\d+\.\d) s in them: train/step\), \d+ img/s", printed)
    assert shown and float(shown.group(1)) > 0, printed
