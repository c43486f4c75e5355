"""``python -m ftjob.check``: every shipped config composes and validates; a broken config dir
fails, naming the file and the key. No Ray: composition and validation only."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ftjob.cli.check import ERROR, NEEDS, OK, Verdict, check_all, exit_status, main

CONF = Path(str(files("ftjob.conf")))


def by_label(verdicts: list[Verdict]) -> dict[str, Verdict]:
    return {v.target.label: v for v in verdicts}


TINY = "# @package _global_\ndefaults:\n  - override /chaos: worker_killer\ntrainer:\n  epochs: 1\n"


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Verdict]]:
    """``python -m ftjob.check --config-dir DIR``: ftjob's conf, and DIR's one experiment."""
    root = tmp_path_factory.mktemp("conf")
    (root / "experiment").mkdir()
    (root / "experiment" / "tiny.yaml").write_text(TINY)
    return root, by_label(check_all(str(root)))


@pytest.fixture(scope="module")
def shipped(checked) -> dict[str, Verdict]:
    root, verdicts = checked
    return {label: v for label, v in verdicts.items() if not label.startswith(str(root))}


def test_a_config_dir_is_checked_beside_ftjob_conf(checked, shipped) -> None:
    root, verdicts = checked
    assert set(verdicts) - set(shipped) == {f"{root}/experiment/tiny.yaml"}
    assert verdicts[f"{root}/experiment/tiny.yaml"].status == OK
    assert "config.yaml" in shipped and "experiment/digits_ft.yaml" in shipped


def test_every_shipped_experiment_and_sweep_preset_is_checked(shipped) -> None:
    expected = {"config.yaml"} | {
        f"{group}/{path.name}"
        for group in ("experiment", "sweep")
        for path in (CONF / group).glob("*.yaml")
    }
    assert expected <= set(shipped)
    assert {
        "sweep/retry_policy.yaml",
        "sweep/kill_interval.yaml",
        "sweep/checkpoint_vs_kill.yaml",
    } <= set(shipped)


def test_shipped_sweep_presets_pass_for_every_swept_value(shipped) -> None:
    for label in (
        "sweep/retry_policy.yaml",
        "sweep/kill_interval.yaml",
        "sweep/checkpoint_vs_kill.yaml",
    ):
        verdict = shipped[label]
        assert verdict.status == OK, verdict.line()
    assert shipped["sweep/retry_policy.yaml"].detail.startswith("6 combination(s)")


def test_a_value_supplied_at_run_time_is_needs_not_an_error(shipped) -> None:
    verdict = shipped["dataset/imagenet.yaml"]

    assert verdict.status == NEEDS and "dataset.path" in verdict.detail
    assert exit_status([verdict, shipped["config.yaml"]]) == 0


def test_shipped_conf_passes(shipped) -> None:
    assert exit_status(list(shipped.values())) == 0, [v.line() for v in shipped.values()]


# -- a user's config dir ---------------------------------------------------------------------

BROKEN_FILES = {
    "experiment/bad_value.yaml": "# @package _global_\ntrainer:\n  epochs: 0\n",
    "experiment/unknown_key.yaml": "# @package _global_\ntrainer:\n  epochz: 3\n",
    "experiment/bad_target.yaml": "# @package _global_\nmodel:\n  _target_: no_such_module.Net\n",
    "experiment/not_global.yaml": "trainer:\n  epochs: 2\n",
    "experiment/bad_yaml.yaml": "# @package _global_\ntrainer: [1\n",
    "sweep/bad_value.yaml": "# @package _global_\nhydra:\n  sweeper:\n    params:\n      chaos.interval: 5,-1\n",
    "sweep/bad_key.yaml": "# @package _global_\nhydra:\n  sweeper:\n    params:\n      chaos.intervall: 5,10\n",
    "sweep/no_params.yaml": "# @package _global_\ntrainer:\n  epochs: 1\n",
    "dataset/typo.yaml": "_target_: ftjob.datasets.DigitsDataset\nimage_sise: 16\n",
    "trainer/zero_workers.yaml": "num_workers: 0\n",
    "checkpoint/bad_regex.yaml": "defaults:\n  - default\n  - _self_\nretry:\n  retry_on: ['(unclosed']\n",
    "dataset/two_channel_mean.yaml": "_target_: ftjob.datasets.ImageFolderDataset\npath: /data\nmean: [0.5, 0.5]\n",
    "trainer/gpu_without_use_gpu.yaml": "defaults:\n  - default\n  - _self_\nresources_per_worker: {CPU: 1, GPU: 1}\n",
    "model/no_num_classes.yaml": "_target_: torch.nn.Flatten\n",
    "experiment/local_disk_on_cluster.yaml": "# @package _global_\nray:\n  address: 10.0.0.1:6379\ncheckpoint:\n  storage_path: /scratch/ckpt\n",
}
# What the ERROR line must name: the rule's key (and, for sweeps, the swept value).
EXPECTED_KEYS = {
    "experiment/bad_value.yaml": "trainer.epochs=0",
    "experiment/unknown_key.yaml": "trainer.epochz",
    "experiment/bad_target.yaml": "model._target_='no_such_module.Net'",
    "experiment/not_global.yaml": "# @package _global_",
    "experiment/bad_yaml.yaml": "line 2",
    "sweep/bad_value.yaml": "chaos.interval=-1",
    "sweep/bad_key.yaml": "chaos.intervall",
    "sweep/no_params.yaml": "hydra.sweeper.params",
    "dataset/typo.yaml": "dataset.image_sise",
    "trainer/zero_workers.yaml": "trainer.num_workers=0",
    "checkpoint/bad_regex.yaml": "checkpoint.retry.retry_on",
    "dataset/two_channel_mean.yaml": "dataset.mean=[0.5, 0.5]: must have 3 values",
    "trainer/gpu_without_use_gpu.yaml": "trainer.resources_per_worker",
    "model/no_num_classes.yaml": "takes no 'num_classes' argument",
    "experiment/local_disk_on_cluster.yaml": "checkpoint.storage_path='/scratch/ckpt'",
}
GOOD_FILES = {
    "experiment/tiny.yaml": TINY,
    "experiment/on_imagenet.yaml": "# @package _global_\ndefaults:\n  - override /dataset: imagenet\n",
    "sweep/seeds.yaml": "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.seed: 0,1,2\n",
    "my_config.yaml": "defaults:\n  - config\n  - _self_\ntrainer:\n  epochs: 1\n",
}


def write_config_dir(root: Path, contents: dict[str, str]) -> Path:
    for name, text in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def user_verdicts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Verdict]]:
    root = write_config_dir(tmp_path_factory.mktemp("user_conf"), {**BROKEN_FILES, **GOOD_FILES})
    return root, by_label(check_all(str(root), only_config_dir=True))


@pytest.mark.parametrize("name", sorted(BROKEN_FILES))
def test_a_broken_file_is_an_error_naming_file_and_key(user_verdicts, name: str) -> None:
    root, verdicts = user_verdicts
    verdict = verdicts[f"{root}/{name}"]

    assert verdict.status == ERROR
    assert EXPECTED_KEYS[name] in verdict.detail, verdict.line()


def test_a_users_good_files_pass(user_verdicts) -> None:
    root, verdicts = user_verdicts

    assert verdicts[f"{root}/experiment/tiny.yaml"].status == OK
    assert verdicts[f"{root}/sweep/seeds.yaml"].status == OK
    assert verdicts[f"{root}/sweep/seeds.yaml"].detail.startswith("3 combination(s)")
    assert verdicts[f"{root}/my_config.yaml"].status == OK  # a primary config in the user's dir
    needs = verdicts[f"{root}/experiment/on_imagenet.yaml"]
    assert needs.status == NEEDS and needs.detail.startswith("dataset.path: set dataset.path=")


def test_command_exits_non_zero_with_one_line_per_file(tmp_path: Path) -> None:
    # The CI contract, as a subprocess: exit status and the ERROR line.
    write_config_dir(
        tmp_path, {"experiment/broken.yaml": BROKEN_FILES["experiment/bad_value.yaml"]}
    )

    proc = subprocess.run(
        [sys.executable, "-m", "ftjob.check", "--config-dir", str(tmp_path), "--only-config-dir"],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines == [
        f"ERROR  {tmp_path}/experiment/broken.yaml: trainer.epochs=0: must be >= 1",
        "ftjob.check: 1 configs: 0 ok, 0 need values at run time, 1 with errors",
    ]


def test_only_config_dir_needs_a_config_dir_with_configs_in_it(tmp_path: Path, capsys) -> None:
    assert main(["--only-config-dir"]) == 2
    assert "--only-config-dir needs --config-dir DIR" in capsys.readouterr().err
    # A wrong path in a CI step must not pass as "nothing wrong".
    assert main(["--config-dir", str(tmp_path), "--only-config-dir"]) == 2
    assert "no config files in it" in capsys.readouterr().err


def test_missing_config_dir_is_a_usage_error(tmp_path: Path, capsys) -> None:
    assert main(["--config-dir", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_custom_model_and_dataset_example_checks_clean(monkeypatch) -> None:
    """examples/custom_model_dataset: the user's own _target_s and config dir compose, bind and
    validate, as README's one command needs."""
    example = Path(__file__).resolve().parents[3] / "examples" / "custom_model_dataset"
    monkeypatch.syspath_prepend(str(example))
    verdicts = check_all(str(example / "conf"), only_config_dir=True)
    assert all(v.target.label.startswith(str(example)) for v in verdicts)
    assert {v.target.label.rsplit("/", 2)[-2] for v in verdicts} == {
        "model",
        "dataset",
        "experiment",
    }
    assert all(v.status == OK for v in verdicts), [v.line() for v in verdicts]
    assert exit_status(verdicts) == 0


# -- python -m ftjob.check --data: every file decoded up front --------------------------------


def test_check_data_decodes_every_file_in_parallel_and_lists_the_bad_ones(tmp_path: Path, capsys):
    from tests.support.images import bad_tree

    bad = bad_tree(tmp_path)
    big = tmp_path / "val" / "a" / "big.png"
    Image.fromarray(np.zeros((120, 100, 3), np.uint8)).save(big)
    args = ["dataset=imagefolder", f"dataset.path={tmp_path}", "dataset.max_image_pixels=10000"]
    assert main(["--data", "--jobs", "2", *args]) == 1
    out = capsys.readouterr().out.splitlines()
    listed = sorted(line for line in out if line.startswith("BAD"))
    assert listed == [
        f"BAD    train {bad['empty']}: UnidentifiedImageError: no image format PIL reads "
        "recognises its bytes",
        f"BAD    train {bad['truncated']}: OSError: image file is truncated",
        f"BAD    val {big}: ImageTooLarge: 100x120 = 12000 pixels, more than "
        "dataset.max_image_pixels=10000",
    ]
    assert "decoding 48 train + 9 val files in 2 process(es)" in out[0]
    assert out[-3].startswith("ftjob.check --data: 3 bad file(s) of 57")
    # What dataset.max_bad_fraction (0.01: none of 48, none of 9) makes of them, per split.
    assert out[-2].startswith(
        "ftjob.check --data: with dataset.bad_files=skip a run fails: 2 of the 48 train samples"
    )
    assert out[-1].startswith("ftjob.check --data: with dataset.bad_files=skip a run fails: 1 of")
    for path in (*bad.values(), big):
        path.unlink()
    assert main(["--data", "--jobs", "2", *args]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ftjob.check --data: all 54 files decode"


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two cores to allow one",
)
def test_check_data_sizes_its_pool_by_the_cores_it_may_use(tmp_path: Path, capsys) -> None:
    # Allowed one core of several (taskset, a scheduler's cgroup): one decoding process, not
    # one per core of the host.
    from tests.support.images import write_images

    write_images(tmp_path, per_class=2, val=1)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert main(["--data", "dataset=imagefolder", f"dataset.path={tmp_path}"]) == 0
    finally:
        os.sched_setaffinity(0, allowed)
    assert os.cpu_count() != 1 and "files in 1 process(es)" in capsys.readouterr().out


def test_check_data_refuses_a_tree_that_fails_its_audit_before_decoding(tmp_path: Path, capsys):
    from tests.support.images import write_images

    write_images(tmp_path, per_class=2, val=1)
    (tmp_path / "train" / "c").mkdir()  # a class folder without images
    assert main(["--data", "dataset=imagefolder", f"dataset.path={tmp_path}"]) == 1
    out = capsys.readouterr().out
    assert "class folder(s) without images under train/: c;" in out and "BAD" not in out
    assert main(["dataset.path=/x"]) == 2  # overrides without --data: a wrong command
