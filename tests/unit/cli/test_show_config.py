"""What a newcomer's first look at the command line shows: ``--version`` is ftjob's, and
``--cfg job`` prints the config as a run would take it -- checked first (the same one-line
errors and exit 2), without a secret, without the null aliases of keys spelled the old way."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

import ftjob
from ftjob.cli.main import main
from ftjob.config import RENAMED_FAILURE_KEYS
from tests.support.processes import ray_temp_dir

SECRETS = ("sEcReT-aws-0123456789", "Bearer tok-abcdef-123456", "wandb-key-0123456789")


def ftjob_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    ray_env, _ = ray_temp_dir(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "ftjob", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ray_env},
    )


def test_version_is_ftjobs(tmp_path: Path) -> None:
    proc = ftjob_command(tmp_path, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ftjob {ftjob.__version__} (Python "), proc.stdout
    assert (
        f"Hydra {version('hydra-core')}" in proc.stdout and f"Ray {version('ray')}" in proc.stdout
    )
    assert version("ftjob") == ftjob.__version__  # the installed metadata says the same


def test_cfg_job_prints_the_config_without_secrets_or_the_old_spellings(tmp_path: Path) -> None:
    proc = ftjob_command(
        tmp_path,
        "--cfg",
        "job",
        f"++checkpoint.storage_options={{key:AKIAEXAMPLE,secret:{SECRETS[0]},"
        f"client_kwargs:{{headers:[[Authorization,'{SECRETS[1]}']]}}}}",
        f"++ray.runtime_env={{env_vars:{{WANDB_API_KEY:{SECRETS[2]}}}}}",
        "failure.hang_timeout=30",  # an old spelling still works: shown where it lives now
    )
    assert proc.returncode == 0, proc.stderr
    for secret in SECRETS:
        assert secret not in proc.stdout + proc.stderr
    shown = yaml.safe_load(proc.stdout)
    options = shown["checkpoint"]["storage_options"]
    assert options["secret"] == "<redacted>" and options["key"] == "<redacted>"
    assert options["client_kwargs"]["headers"] == [["Authorization", "<redacted>"]]
    assert shown["ray"]["runtime_env"]["env_vars"]["WANDB_API_KEY"] == "<redacted>"
    assert not set(RENAMED_FAILURE_KEYS) & set(shown["failure"]), shown["failure"]
    assert shown["failure"]["hang"]["timeout"] == 30
    assert shown["trainer"]["epochs"] == 3 and "hydra" not in shown
    assert (
        proc.stderr == "ftjob: failure.hang_timeout is deprecated: it is failure.hang.timeout now\n"
    )


@pytest.mark.parametrize("info", [["--info"], ["--info", "config"], ["-i", "all"]])
def test_info_that_would_print_the_config_in_the_clear_points_to_cfg_job(info, capsys) -> None:
    secret = "++checkpoint.storage_options={secret:" + SECRETS[0] + "}"
    assert main([*info, secret]) == 2
    out, err = capsys.readouterr()
    assert SECRETS[0] not in out + err and "--cfg job" in err and out == ""


def test_info_of_the_search_path_answers_as_hydras(tmp_path: Path) -> None:
    proc = ftjob_command(tmp_path, "--info", "searchpath")
    assert proc.returncode == 0, proc.stderr
    assert "pkg://ftjob.conf" in proc.stdout, proc.stdout


def test_cfg_hydra_and_a_package_are_printed_as_hydra_prints_them(capsys) -> None:
    secret = "++checkpoint.storage_options={secret:" + SECRETS[0] + "}"
    assert main(["--cfg", "hydra", secret]) == 0
    out = capsys.readouterr().out
    hydra = yaml.safe_load(out)["hydra"]
    assert (
        SECRETS[0] not in out and "help" not in hydra and hydra["run"]["dir"].startswith("outputs/")
    )
    assert main(["--cfg", "job", "-p", "trainer", "trainer.epochs=7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# @package trainer\n") and yaml.safe_load(out)["epochs"] == 7
    assert main(["--cfg", "job", "--package", "trainer.epochs"]) == 0
    assert capsys.readouterr().out == "3\n"
    assert main(["--cfg", "job", "-p", "trainer.nothing"]) == 1  # as Hydra answers it
    assert capsys.readouterr().err == "package 'trainer.nothing' not found in config\n"


@pytest.mark.parametrize("show", [(), ("--cfg", "job")])
def test_a_bad_key_is_one_line_naming_what_was_typed_with_or_without_cfg(show, capsys) -> None:
    assert main([*show, "trainr.epochs=3"]) == 2
    assert capsys.readouterr() == (
        "",
        "ftjob: config error: trainr.epochs='3': unknown key (Key 'trainr' not in 'JobConfig'); "
        "check the spelling, or see the keys with --cfg job\n",
    )
    assert main([*show, "trainer.epochs=-1"]) == 2
    assert capsys.readouterr().err.startswith("ftjob: config error: trainer.epochs=-1: ")
    # An interpolation that does not resolve: named as it was written, not as a traceback.
    assert main([*show, "name=${oc.env:FTJOB_TEST_UNSET_VARIABLE}"]) == 2
    assert capsys.readouterr().err.startswith(
        "ftjob: config error: name='${oc.env:FTJOB_TEST_UNSET_VARIABLE}': "
    )
