"""resume=true and resume=auto in a whole job in this process (tests/support/local_run.py): a
finished run resumed with fewer epochs is refused before training; the same command run twice
with resume=auto starts the run, then continues it exactly where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftjob.driver.resume import (
    ResumeError,
)
from ftjob.record import RunSnapshot
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally, stop_when
from tests.support.summaries import exactly_once


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


@pytest.mark.worker
def test_the_same_command_with_resume_auto_starts_the_run_then_continues_it_exactly(
    tmp_path: Path,
):
    # What a scheduler does after the driver died: the same command again. Here the first
    # driver is stopped part-way (its just-in-time checkpoint is the newest committed one).
    command = (
        "+experiment=digits_ft",  # 22 steps of 64 an epoch
        "name=requeued",
        f"checkpoint.storage_path={tmp_path / 'store'}",
        "resume=auto",
        "trainer.epochs=2",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "trainer.audit_samples=true",
        "chaos=disabled",
    )

    def past_step_15(snap: RunSnapshot) -> bool:
        return any(a.max_step >= 15 for a in snap.attempts)

    first = run_locally(compose_job(*command), tmp_path / "a", during=stop_when(past_step_15))
    url = first.prep.fs.unstrip_protocol(first.prep.run_path)
    assert first.prep.notes[0] == (
        f"resume=auto: no committed checkpoint of run 'requeued' at {url}: starting it"
    )
    assert first.summary["status"] == "preempted", (first.summary["error"], first.errors)
    assert first.summary["config"]["resume"] == "auto"
    [notice] = [a.preemption for a in first.snapshot.attempts if a.preemption]
    stopped = notice.jit.step
    assert 15 <= stopped < 22 and notice.jit.path
    [trained] = first.summary["audit"]
    assert trained["unique"] == stopped * 64 and trained["duplicates"] == 0

    second = run_locally(compose_job(*command), tmp_path / "b")
    assert second.prep.notes[0] == (
        f"resume=auto: run 'requeued' has a committed checkpoint at step {stopped} in {url}: "
        "continuing it"
    )
    s = second.summary
    assert s["status"] == "succeeded", (s["error"], second.errors)
    assert s["config"]["resume"] == "auto"
    assert [f["restored_step"] for f in s["failures"]] == []
    epoch0, epoch1 = s["audit"]
    # Across both runs every sample of each epoch once: the first trained the first
    # `stopped` steps of epoch 0, the second the rest, then epoch 1.
    assert epoch0["resumed_at"] == stopped * 64
    assert epoch0["unique"] == (22 - stopped) * 64 and exactly_once(epoch0)
    assert epoch1["unique"] == 1408 and exactly_once(epoch1)
    assert s["validation"][-1]["step"] == 44


@pytest.mark.worker
def test_a_resume_refuses_another_optimizer_before_training_and_says_what_it_honours(
    tmp_path: Path,
):
    # The checkpoint's optimizer state would put its own hyperparameters back (torch's
    # load_state_dict): a new weight decay would be written in config.json, never trained with.
    common = (
        "+experiment=digits_ft",
        "name=wd",
        f"checkpoint.storage_path={tmp_path / 's'}",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "chaos=disabled",
        "checkpoint.memory.enabled=false",
    )
    first = run_locally(
        compose_job(*common, "trainer.epochs=1", "optimizer.weight_decay=0.0"), tmp_path / "a"
    )
    assert first.summary["status"] == "succeeded", first.errors
    adam = ("optimizer._target_=torch.optim.Adam", "optimizer.weight_decay=0.3")
    with pytest.raises(ResumeError) as err:
        run_locally(compose_job(*common, "resume=true", "trainer.epochs=2", *adam), tmp_path / "b")
    said = str(err.value)
    assert "optimizer._target_: 'torch.optim.AdamW' -> 'torch.optim.Adam'" in said
    assert "optimizer.weight_decay: 0.0 -> 0.3 (the checkpoint's optimizer state" in said
    assert not (tmp_path / "b" / "summary.json").exists()  # refused before training
    # What it honours it says, one line a key, before training.
    second = run_locally(
        compose_job(
            *common,
            "resume=true",
            "trainer.epochs=2",
            "optimizer.weight_decay=0.0",
            "trainer.label_smoothing=0.1",
        ),
        tmp_path / "c",
    )
    assert second.summary["status"] == "succeeded", second.errors
    assert [n for n in second.prep.notes if n.startswith("resume: ")] == [
        "resume: trainer.epochs: 1 -> 2 (changed since the checkpoint; allowed)",
        "resume: trainer.label_smoothing: 0.0 -> 0.1 (changed since the checkpoint; allowed)",
    ]
