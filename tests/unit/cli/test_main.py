"""The command line without traps: ``experiment=NAME`` with or without the ``+``, Hydra's hint
kept where a config has no experiment default, an ftjob ``--help``, and a run dir that cannot be
made refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from ftjob.cli.main import cannot_make_dir, main, precheck, spell_argv
from ftjob.config import ConfigError, to_plain
from tests.support.jobs import compose_job
from tests.support.processes import ray_temp_dir


def test_an_experiment_is_chosen_with_or_without_the_plus() -> None:
    plain, plus = compose_job("experiment=digits_ft"), compose_job("+experiment=digits_ft")
    assert to_plain(plain) == to_plain(plus)
    assert plain.trainer.validate_every_n_steps == 20  # digits_ft's, not the default's
    # What Hydra gets: the group already in the defaults list loses its +; keys do not.
    args = ["-m", "+experiment=digits_ft", "+trainer.extra=1", "++x=1", "chaos.interval=5,10"]
    assert spell_argv(args) == ["-m", "experiment=digits_ft", *args[2:]]


def test_a_config_without_an_experiment_default_keeps_hydras_hint(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ftjob_schema\n  - _self_\n")
    with pytest.raises(ConfigError) as refused:
        try:
            precheck(["--config-dir", str(tmp_path), "-cn", "mine", "experiment=digits_ft"])
        finally:
            GlobalHydra.instance().clear()
    assert str(refused.value).endswith("use +experiment=digits_ft"), str(refused.value)


def test_help_is_ftjobs_and_lists_every_group(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["ftjob"])
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("ftjob: declarative, fault-tolerant training jobs on Ray Train")
    assert "powered by Hydra" not in out
    for group in ("chaos", "checkpoint", "dataset", "experiment", "logger", "model", "sweep"):
        assert f"\n{group}: " in out, group
    assert "experiment: digits_elastic, digits_ft, imagenet_ft, imagenet_resnet50" in out
    assert out.count("  ftjob experiment=") == 3  # three example commands
    assert "outputs/DATE/TIME/" in out and "--cfg,-c" in out  # where outputs go; Hydra's flags


def test_an_argument_that_is_no_override_stops_with_one_line_naming_it(capsys) -> None:
    # A bare experiment name: the line names it and the override it likely meant; exit 2.
    assert main(["imagenet_ft"]) == 2
    assert capsys.readouterr().err == (
        "ftjob: config error: argument='imagenet_ft': not an override (Hydra: missing EQUAL at "
        "'<EOF>'); write name=value (here: experiment=imagenet_ft)\n"
    )
    with pytest.raises(ConfigError, match=r"^argument='trainer.epochs=\[1': not an override "):
        precheck(["experiment=digits_ft", "trainer.epochs=[1"])


@pytest.mark.parametrize("sweep", [False, True])
def test_a_run_dir_that_cannot_be_made_exits_2_with_one_line_naming_it(tmp_path, sweep):
    # Under a regular file: nothing can be made there, whoever runs the test (root included).
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    args = ["-m", "trainer.epochs=1,2"] if sweep else []
    ray_env, ray_started = ray_temp_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ftjob", "+experiment=digits_ft", *args, f"{key}={blocker}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ray_env},
    )
    assert proc.returncode == 2, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line == (
        f"ftjob: config error: {key}='{blocker}/run': {blocker} is not a directory, so nothing "
        f"can be made under it: choose a directory you may create ({key}=DIR)"
    )
    assert "HYDRA_FULL_ERROR" not in proc.stdout + proc.stderr
    assert not ray_started.exists() and blocker.read_text() == "not a directory"


def test_what_may_be_made_a_run_dir(tmp_path):
    (tmp_path / "f").write_text("")
    assert cannot_make_dir(str(tmp_path / "f")) == "it exists and is not a directory"
    assert cannot_make_dir(str(tmp_path / "f" / "a" / "b")) == (
        f"{tmp_path / 'f'} is not a directory, so nothing can be made under it"
    )
    assert cannot_make_dir(str(tmp_path)) is None
    assert cannot_make_dir(str(tmp_path / "new" / "deeper")) is None
    assert not (tmp_path / "new").exists()  # looked at, not made
