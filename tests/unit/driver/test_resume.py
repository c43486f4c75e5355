"""resume=true and resume=auto: what a checkpoint remembers of its config and train data, and what a resumed
run may change (no Ray: a committed checkpoint written by hand)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from fsspec.implementations.local import LocalFileSystem

from ftjob import metrics as M
from ftjob.config import ChaosConfig, JobConfig, TrainerConfig, to_plain
from ftjob.driver.resume import (
    NothingLeftToTrain,
    ResumeError,
    Resumption,
    catalog_fingerprint,
    check_resume,
    check_run_name,
    check_run_place,
    finished_line,
)
from ftjob.driver.runner import prepare, resume_command
from ftjob.storage.catalog import CheckpointCatalog
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.lease import RunLease
from tests.support.images import make_image_tree
from tests.support.jobs import compose_job

DIGITS = {"_target_": "ftjob.datasets.DigitsDataset"}
MODEL = {"_target_": "ftjob.models.SmallCNN"}


def catalog(paths: list[str], labels: list[int]) -> pa.Table:
    return pa.table({"id": list(range(len(paths))), "label": labels, "path": paths})


def job(**trainer: object) -> JobConfig:
    return JobConfig(
        model=dict(MODEL),
        dataset=dict(DIGITS),
        trainer=TrainerConfig(**trainer),
        name="r",
        resume=True,
    )


def store_with_checkpoint(
    tmp_path: Path, saved: JobConfig, data: dict, step: int = 10
) -> CheckpointStore:
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(to_plain(saved)))
    (local / "state.json").write_text(json.dumps({"step": step, "data": data}))
    store = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "r"))
    store.commit(str(local), step)
    return store


def test_the_fingerprint_follows_the_data_not_where_it_lives():
    here = catalog(["/data/a/1.jpg", "/data/b/2.jpg"], [0, 1])
    moved = catalog(["s3://bucket/imgs/a/1.jpg", "s3://bucket/imgs/b/2.jpg"], [0, 1])
    relabelled = catalog(["/data/a/1.jpg", "/data/b/2.jpg"], [1, 0])
    smaller = catalog(["/data/a/1.jpg"], [0])
    assert catalog_fingerprint(here, 2) == catalog_fingerprint(moved, 2)
    assert catalog_fingerprint(here, 2) != catalog_fingerprint(relabelled, 2)
    assert catalog_fingerprint(smaller, 2)["train_rows"] == 1
    assert catalog_fingerprint(here, 3)["num_classes"] == 3


def test_a_resume_on_other_train_data_is_refused_with_the_diff(tmp_path: Path):
    before = catalog_fingerprint(catalog(["/d/a/1.jpg", "/d/b/2.jpg"], [0, 1]), 2)
    after = catalog_fingerprint(catalog(["/d/a/1.jpg"], [0]), 2)
    store = store_with_checkpoint(tmp_path, job(), before)
    with pytest.raises(ResumeError) as err:
        check_resume(job(), store, "file:///storage/r", after)
    assert "train data train_rows: 2 -> 1" in str(err.value)
    assert check_resume(job(), store, "file:///storage/r", before) == []


def test_a_changed_dataset_option_is_refused(tmp_path: Path):
    data = {"train_rows": 1, "train_sha256": "x", "num_classes": 10}
    store = store_with_checkpoint(tmp_path, job(), data)
    changed = replace(job(), dataset={**DIGITS, "val_fraction": 0.3})
    with pytest.raises(ResumeError, match="dataset.val_fraction: None -> 0.3"):
        check_resume(changed, store, "u", data)


def test_more_epochs_or_another_learning_rate_are_allowed_and_stated(tmp_path: Path):
    data = {"train_rows": 1, "train_sha256": "x", "num_classes": 10}
    store = store_with_checkpoint(tmp_path, job(epochs=3, lr=0.01), data)
    stated = check_resume(job(epochs=5, lr=0.005), store, "u", data)
    assert stated == [
        "trainer.epochs: 3 -> 5 (changed since the checkpoint; allowed)",
        "trainer.lr: 0.01 -> 0.005 (changed since the checkpoint; allowed)",
    ]


# 640 training rows, global batch 2 x 32: 10 steps an epoch.
ROWS_640 = {"train_rows": 640, "train_sha256": "x", "num_classes": 10}


@pytest.mark.parametrize(
    "step, epochs, said",
    [
        (25, 2, "checkpoint is at step 25, and 2 epochs of 10 steps are 20 (5 steps past them)"),
        (30, 3, "checkpoint is at step 30, and 3 epochs of 10 steps are 30 (all of them)"),
    ],
)
def test_a_resume_with_no_steps_left_to_train_is_refused(tmp_path, step, epochs, said):
    store = store_with_checkpoint(tmp_path, job(epochs=5), ROWS_640, step=step)
    with pytest.raises(ResumeError) as err:
        check_resume(job(epochs=epochs), store, "u", ROWS_640)
    assert f"trainer.epochs={epochs}: run 'r' has nothing left to train" in str(err.value)
    assert said in str(err.value)
    assert f"pass trainer.epochs={step // 10 + 1} or more" in str(err.value)
    stated = check_resume(job(epochs=step // 10 + 1), store, "u", ROWS_640)
    assert stated == [
        f"trainer.epochs: 5 -> {step // 10 + 1} (changed since the checkpoint; allowed)"
    ]


def test_the_learning_rate_schedule_keys_a_resume_changes_are_stated(tmp_path: Path):
    store = store_with_checkpoint(tmp_path, job(epochs=5), ROWS_640, step=25)
    changed = job(epochs=5, warmup_epochs=0.5, lr_reference_batch=256)
    stated = check_resume(changed, store, "u", ROWS_640)
    assert [line.split(":")[0] for line in stated] == [
        "trainer.lr_reference_batch",
        "trainer.warmup_epochs",
    ]


def test_chaos_steps_behind_the_checkpoint_are_said_not_to_be_reached(tmp_path: Path):
    store = store_with_checkpoint(tmp_path, job(epochs=5), ROWS_640, step=25)
    resumed = replace(job(epochs=5), chaos=ChaosConfig(fail_at_steps=[5, 25, 30]))
    assert check_resume(resumed, store, "u", ROWS_640) == [
        "chaos.fail_at_steps: [] -> [5, 25, 30] (changed since the checkpoint; allowed)",
        "chaos.fail_at_steps: [5, 25] are at or behind the checkpoint's step 25: not reached",
    ]


def test_run_names_are_never_reused_silently(tmp_path: Path):
    data = {"train_rows": 1, "train_sha256": "x", "num_classes": 10}
    store = store_with_checkpoint(tmp_path, job(), data)
    with pytest.raises(ResumeError, match="pass resume=true"):
        check_run_name(replace(job(), resume=False), store, "u")
    assert check_run_name(job(), store, "u") == Resumption(True, 10)
    empty = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "other"))
    with pytest.raises(ResumeError, match="no committed checkpoint"):
        check_run_name(job(), empty, "u")


def test_a_run_directory_inside_another_runs_is_refused(tmp_path: Path):
    fs = LocalFileSystem()
    other = tmp_path / "store" / "run-a"
    RunLease(fs, str(other), 60.0, run_name="run-a").acquire()  # a run: its lease
    for storage in (other, other / "checkpoints", other / "checkpoints" / "step_000000010"):
        with pytest.raises(ResumeError, match=r"inside the directory of run 'run-a'"):
            check_run_place(fs, str(storage), str(storage / "run-b"), None)
    # A run whose lease is gone but whose checkpoints are there is a run all the same.
    data = {"train_rows": 1, "train_sha256": "x", "num_classes": 10}
    store = store_with_checkpoint(tmp_path, job(), data)  # .../storage/r, no lease
    with pytest.raises(ResumeError, match=r"inside the directory of run 'r'"):
        check_run_place(fs, store.root, f"{store.root}/run-b", None)
    beside = tmp_path / "store"  # the storage root that holds both: as meant
    check_run_place(fs, str(beside), str(beside / "run-b"), None)


def test_checkpoints_in_the_dataset_are_refused(tmp_path: Path):
    fs, data = LocalFileSystem(), tmp_path / "images"
    data.mkdir()
    for storage in (data, data / "train", f"file://{data}/ck"):
        run = f"{str(storage).removeprefix('file://')}/run"
        with pytest.raises(ResumeError, match=r"inside dataset.path="):
            check_run_place(fs, str(storage), run, str(data))
    check_run_place(fs, str(tmp_path / "ck"), str(tmp_path / "ck" / "run"), str(data))
    check_run_place(fs, "s3://bucket/images/ck", "bucket/images/ck/run", str(data))


def test_the_driver_refuses_checkpoints_in_the_dataset_before_its_lease(tmp_path: Path):
    images = make_image_tree(tmp_path / "images", classes=2, train_per_class=4, val_per_class=2)
    refused = compose_job(
        "dataset=imagefolder",
        f"dataset.path={images}",
        f"checkpoint.storage_path={images}",
        "trainer.num_workers=1",
        "trainer.batch_size=2",
    )
    with pytest.raises(ResumeError, match="inside dataset.path="):
        prepare(refused, str(tmp_path / "run"))
    assert sorted(p.name for p in Path(images).iterdir()) == ["train", "val"]


# -- resume=auto: continue the run if it has a committed checkpoint, start it otherwise --------


def auto(**trainer: object) -> JobConfig:
    return replace(job(**trainer), resume="auto")


def test_resume_auto_continues_a_run_with_a_committed_checkpoint_with_every_check(tmp_path):
    store = store_with_checkpoint(tmp_path, job(epochs=5), ROWS_640, step=25)
    assert check_run_name(auto(epochs=5), store, "file:///s/r") == Resumption(
        True,
        25,
        "resume=auto: run 'r' has a committed checkpoint at step 25 in file:///s/r: continuing it",
    )
    assert check_resume(auto(epochs=5), store, "u", ROWS_640) == []
    changed = replace(auto(epochs=5), dataset={**DIGITS, "val_fraction": 0.3})
    with pytest.raises(ResumeError) as err:  # the checks of resume=true, said as auto
        check_resume(changed, store, "u", ROWS_640)
    said = str(err.value)
    assert said.startswith("resume=auto: run 'r' cannot continue with this config or data")
    assert "dataset.val_fraction: None -> 0.3" in said and "(choose another name)" in said
    smaller = {**ROWS_640, "train_rows": 639}
    with pytest.raises(ResumeError, match="train data train_rows: 640 -> 639"):
        check_resume(auto(epochs=5), store, "u", smaller)


def test_resume_auto_starts_a_run_that_has_no_checkpoint(tmp_path: Path):
    empty = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "r"))
    assert check_run_name(auto(), empty, "file:///s/r") == Resumption(
        False, None, "resume=auto: no committed checkpoint of run 'r' at file:///s/r: starting it"
    )
    assert check_resume(auto(), empty, "u", ROWS_640) == []
    assert check_run_name(replace(job(), resume=False), empty, "u") == Resumption(False)


def test_resume_auto_starts_over_uploads_that_never_completed_as_the_restore_does(
    tmp_path: Path,
):
    # A driver killed while its first checkpoint uploaded: a directory without a manifest is
    # no checkpoint (the workers' restore passes it over and sets it aside).
    store = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "r"))
    half = Path(store.path_for(10))
    half.mkdir(parents=True)
    (half / "model.g1a0-abc.pt").write_bytes(b"half an upload")
    decided = check_run_name(auto(), store, "U")
    assert not decided.continues and decided.said == (
        "resume=auto: no committed checkpoint of run 'r' at U (steps [10]: uploads that never "
        "completed): starting it"
    )
    with pytest.raises(ResumeError, match="resume=true: no committed checkpoint of run 'r'"):
        check_run_name(job(), store, "U")  # as before
    with pytest.raises(ResumeError, match="already has checkpoints"):
        check_run_name(replace(job(), resume=False), store, "U")


def test_resume_auto_refuses_a_run_whose_committed_checkpoints_do_not_read(tmp_path: Path):
    store = store_with_checkpoint(tmp_path, job(), ROWS_640, step=10)
    [manifest] = Path(store.path_for(10)).glob("manifest*.json")
    manifest.write_text("{torn")
    for resume, word in ((auto(), "auto"), (job(), "true")):  # as resume=true refuses it
        with pytest.raises(ResumeError) as err:
            check_run_name(resume, store, "U")
        assert str(err.value).startswith(
            f"resume={word}: no committed checkpoint of run 'r' at U (committed, but none "
            "reads: steps [10])"
        )
        assert "look at those checkpoints before starting the run over" in str(err.value)


def test_resume_auto_takes_an_older_committed_checkpoint_past_a_newer_unfinished_upload(
    tmp_path: Path,
):
    store = store_with_checkpoint(tmp_path, job(epochs=5), ROWS_640, step=20)
    Path(store.path_for(30)).mkdir()  # the upload the driver's death cut short
    decided = check_run_name(auto(epochs=5), store, "U")
    assert (decided.continues, decided.step) == (True, 20)


def test_resume_auto_on_a_finished_run_says_so_and_resume_true_refuses(tmp_path: Path):
    store = store_with_checkpoint(tmp_path, job(epochs=3), ROWS_640, step=30)
    with pytest.raises(NothingLeftToTrain) as done:
        check_resume(auto(epochs=3), store, "U", ROWS_640)
    assert (done.value.step, done.value.total) == (30, 30)
    assert finished_line(auto(epochs=3), "U", done.value) == (
        "resume=auto: run 'r' has a committed checkpoint at step 30 in U, its last step "
        "(trainer.epochs=3): the run is finished, nothing to train (pass a larger "
        "trainer.epochs to train on)"
    )
    with pytest.raises(ResumeError, match="drop resume=true"):
        check_resume(job(epochs=3), store, "U", ROWS_640)


def finished_digits_run(tmp_path: Path, *overrides: str) -> JobConfig:
    """digits_ft (22 steps of 64 an epoch, 2 epochs) called ``done`` whose storage holds a
    committed checkpoint of its last step, 44 (written by hand: no training)."""
    storage = tmp_path / "storage"
    finished = compose_job(
        "+experiment=digits_ft",
        "name=done",
        f"checkpoint.storage_path={storage}",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "trainer.epochs=2",
        *overrides,
    )
    local = tmp_path / "local"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps(to_plain(finished)))
    (local / "state.json").write_text(json.dumps({"step": 44}))
    CheckpointStore(LocalFileSystem(), str(storage / "done")).commit(str(local), 44)
    return finished


def test_a_finished_run_rerun_with_resume_auto_succeeds_without_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A scheduler that reruns a finished job (its driver died after the last commit) gets
    # exit 0 and a summary of nothing trained, not a failure to retry.
    from ftjob.driver import runner

    rerun = finished_digits_run(tmp_path, "resume=auto")

    def never(*args: object) -> None:
        raise AssertionError("a finished run trains nothing: no cluster, no workers")

    monkeypatch.setattr(runner, "_train", never)
    lines: list[str] = []
    result = runner.run(rerun, str(tmp_path / "rerun"), echo=lines.append)
    assert result.ok and result.status == "succeeded" and result.error is None
    url = f"file://{tmp_path / 'storage' / 'done'}"
    assert (
        "resume=auto: run 'done' has a committed checkpoint at step 44 in "
        f"{url}, its last step (trainer.epochs=2): the run is finished, nothing to train "
        "(pass a larger trainer.epochs to train on)"
    ) in lines
    written = json.loads(Path(result.summary_path).read_text())
    assert written["status"] == "succeeded" and written["config"]["resume"] == "auto"
    assert written["metrics"][M.TRAIN_STEPS_COMPLETED] == 0 and "resume_command" not in written
    assert written["already_finished"]["step"] == 44
    assert written["checkpoints"]["latest"].endswith("done/checkpoints/step_000000044")
    assert not (tmp_path / "storage" / "done" / "lease").exists()  # nothing written to it
    # resume=true keeps refusing it, as before; more epochs continue it
    with pytest.raises(ResumeError, match="has nothing left to train"):
        prepare(replace(rerun, resume=True), str(tmp_path / "again"))
    more = finished_digits_run(tmp_path / "more", "resume=auto", "trainer.epochs=3")
    prep = prepare(more, str(tmp_path / "more" / "run"))
    where = prep.fs.unstrip_protocol(prep.run_path)
    assert prep.finished is None
    assert prep.notes[0] == (
        f"resume=auto: run 'done' has a committed checkpoint at step 44 in {where}: continuing it"
    )
    prep.lease.release()
    # The command a run that did not succeed prints continues it with resume=true: it names a
    # committed checkpoint, and true refuses an empty storage where auto would start over.
    command, _ = resume_command(["+experiment=digits_ft", "resume=auto", "name=done"], prep)
    assert command.startswith("python -m ftjob +experiment=digits_ft name=done resume=true ")
    assert "resume=auto" not in command


def test_resume_auto_decides_again_when_the_driver_it_waited_out_committed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """resume=auto found no committed checkpoint ("starting it"), then waited out the lease of
    a frozen driver whose workers still trained and committed step 44: the run continues from
    that checkpoint, checked as any continued run -- never a fresh start whose workers would
    restore it unchecked."""
    committed = finished_digits_run(tmp_path / "was", "resume=auto", "trainer.epochs=3")
    storage = tmp_path / "storage"
    rerun = replace(committed, checkpoint=replace(committed.checkpoint, storage_path=str(storage)))
    taken = RunLease.acquire
    waited: list[int] = []

    def wait_out(lease: RunLease) -> str | None:
        if not waited:  # the first take: the frozen driver's workers commit while it waits
            shutil.copytree(
                tmp_path / "was" / "storage" / "done", storage / "done", dirs_exist_ok=True
            )
        waited.append(1)
        return taken(lease)

    monkeypatch.setattr(RunLease, "acquire", wait_out)
    prep = prepare(rerun, str(tmp_path / "run"))
    where = prep.fs.unstrip_protocol(prep.run_path)
    assert len(waited) == 2 and prep.continues and prep.finished is None
    assert prep.notes[0] == (
        f"resume=auto: run 'done' has a committed checkpoint at step 44 in {where}: continuing it"
    )
    prep.lease.release()


def test_a_driver_that_fails_right_after_taking_the_lease_gives_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from ftjob.driver import runner

    job = compose_job(
        "+experiment=digits_ft", "name=held", f"checkpoint.storage_path={tmp_path / 's'}"
    )

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "remember_catalog", full_disk)
    with pytest.raises(OSError, match="No space left"):
        prepare(job, str(tmp_path / "run"))
    monkeypatch.undo()
    # resume=auto lists the checkpoints again once it holds the lease: storage down there.
    take, held = runner._take_run, []

    def taking(*args: Any) -> Any:
        held.append(1)
        return take(*args)

    def down_once_held(store: CheckpointCatalog) -> list[int]:
        if held:
            raise ConnectionError("storage down")
        return []

    monkeypatch.setattr(runner, "_take_run", taking)
    monkeypatch.setattr(CheckpointCatalog, "committed_steps", down_once_held)
    with pytest.raises(ConnectionError, match="storage down"):
        prepare(replace(job, resume="auto"), str(tmp_path / "auto"))
    monkeypatch.undo()
    prep = prepare(job, str(tmp_path / "again"))  # taken at once: nothing to wait out
    assert held and prep.lease.generation == 3
    prep.lease.release()


# -- what a resume may change: refused, or honoured and said (docs/fault-tolerance.md) ---------

ROWS_64 = {"train_rows": 64, "train_sha256": "x", "num_classes": 10}


def refused_lines(tmp_path: Path, saved: JobConfig, resumed: JobConfig) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = store_with_checkpoint(tmp_path, saved, ROWS_64, step=1)
    with pytest.raises(ResumeError) as err:
        check_resume(resumed, store, "u", ROWS_64)
    said = str(err.value)
    assert "revert these changes, or start a new run" in said
    return [line.strip() for line in said.splitlines()[1:-1]]


def test_a_changed_optimizer_is_refused_naming_each_key_its_state_would_override(tmp_path):
    # torch's load_state_dict puts the checkpoint's hyperparameters back with its moments: a
    # new weight decay would be written in config.json and never trained with.
    saved = replace(job(), optimizer={"_target_": "torch.optim.AdamW", "weight_decay": 0.0})
    resumed = replace(job(), optimizer={"_target_": "torch.optim.Adam", "weight_decay": 0.3})
    why = "(the checkpoint's optimizer state puts its own back)"
    assert refused_lines(tmp_path, saved, resumed) == [
        f"optimizer._target_: 'torch.optim.AdamW' -> 'torch.optim.Adam' {why}",
        f"optimizer.weight_decay: 0.0 -> 0.3 {why}",
    ]
    momentum = replace(saved, optimizer={**saved.optimizer, "betas": [0.8, 0.9]})
    assert refused_lines(tmp_path / "added", saved, momentum) == [
        f"optimizer.betas: None -> [0.8, 0.9] {why}"
    ]


def test_a_changed_model_is_refused_naming_each_key(tmp_path: Path):
    wider = replace(job(), model={**MODEL, "width": 64})
    assert refused_lines(tmp_path, job(), wider) == [
        "model.width: None -> 64 (the checkpoint's weights are this model's)"
    ]


def test_trainer_keys_the_checkpoint_was_made_with_are_refused(tmp_path: Path):
    assert refused_lines(tmp_path / "groups", job(), job(weight_decay_norm_and_bias=False)) == [
        "trainer.weight_decay_norm_and_bias (the optimizer state's parameter groups): True -> False"
    ]
    exact = {"exact": True, "num_workers": 2, "batch_size": 32}
    assert refused_lines(tmp_path / "exact", job(), job(**exact)) == [
        "trainer.exact (exact mode's arithmetic, from the run's first step): False -> True",
        "trainer.micro_batch_size (exact mode's micro-batch: its arithmetic): None -> 8",
    ]
    # Exact mode's micro-batch is what counts, not how it is spelled: null is 8 of a 64.
    assert refused_lines(tmp_path / "micro", job(**exact), job(**exact, micro_batch_size=16)) == [
        "trainer.micro_batch_size (exact mode's micro-batch: its arithmetic): 8 -> 16"
    ]
    (tmp_path / "same").mkdir()
    store = store_with_checkpoint(tmp_path / "same", job(**exact), ROWS_64, step=1)
    assert check_resume(job(**exact, micro_batch_size=8), store, "u", ROWS_64) == [
        "trainer.micro_batch_size: None -> 8 (changed since the checkpoint; allowed)"
    ]


def test_every_other_changed_key_is_honoured_and_said_one_line_each(tmp_path: Path):
    # One key of each other group, the world size at the same global batch, and the data moved.
    common = ("+experiment=digits_ft", "name=r", "trainer.num_workers=2", "trainer.batch_size=32")
    saved = compose_job(*common)
    resumed = compose_job(
        *common,
        "resume=true",
        "trainer.num_workers=1",
        "trainer.batch_size=64",
        "trainer.label_smoothing=0.1",
        "checkpoint.num_to_keep=5",
        "checkpoint.memory.max_mb=1024",
        "chaos=worker_killer",
        "failure.max_failures=9",
        "ray.log_to_driver=true",
        "logger.live=true",
    )
    saved = replace(saved, dataset={**saved.dataset, "path": "/data/a"})
    resumed = replace(resumed, dataset={**resumed.dataset, "path": "/data/b"})
    store = store_with_checkpoint(tmp_path, saved, ROWS_64, step=1)
    stated = check_resume(resumed, store, "u", ROWS_64)
    keys = [line.split(":")[0] for line in stated]
    assert keys == [
        "chaos.interval",
        "chaos.kind",
        "chaos.max_kills",
        "checkpoint.memory.max_mb",
        "checkpoint.num_to_keep",
        "dataset.path",
        "failure.max_failures",
        "logger.live",
        "ray.log_to_driver",
        "trainer.batch_size",
        "trainer.label_smoothing",
        "trainer.num_workers",
    ]
    assert "trainer.num_workers: 2 -> 1 (changed since the checkpoint; allowed)" in stated
    assert "dataset.path: '/data/a' -> '/data/b' (changed since the checkpoint; allowed)" in stated
    # Honoured whole: a holder that outlived the last driver takes it too (ftjob.memory).
    assert (
        "checkpoint.memory.max_mb: 2048.0 -> 1024.0 (changed since the checkpoint; allowed)"
    ) in stated


def test_a_key_the_checkpoints_config_predates_is_said_as_such_and_the_run_is_not_a_change(
    tmp_path: Path,
):
    saved = to_plain(replace(job(), resume=False))
    del saved["trainer"]["audit_samples"]
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(saved))
    (local / "state.json").write_text(json.dumps({"step": 1, "data": ROWS_64}))
    store = CheckpointStore(LocalFileSystem(), str(tmp_path / "storage" / "r"))
    store.commit(str(local), 1)
    assert check_resume(job(), store, "u", ROWS_64) == [
        "trainer.audit_samples: (not in the checkpoint's config) -> False (changed since the "
        "checkpoint; allowed)"
    ]
