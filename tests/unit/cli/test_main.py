"""The command line without traps: ``experiment=NAME`` with or without the ``+``, Hydra's hint
kept where a config has no experiment default, and an ftjob ``--help``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from ftjob.cli.main import main, precheck, spell_argv
from ftjob.config import ConfigError, to_plain
from tests.support.jobs import compose_job


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
