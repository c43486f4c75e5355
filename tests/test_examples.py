"""The deployment examples users copy: a KubeRay RayJob and a SLURM batch script. Each runs a
valid ftjob command (checked as ``python -m ftjob`` checks it before Ray starts), keeps its
checkpoints on S3 and takes credentials from the environment, never inline; each lets its
scheduler rerun the job after a driver's death (RayJob backoffLimit, SLURM --requeue) with a
command that continues the run: resume=auto and a run name that stays the same."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml
from hydra.core.global_hydra import GlobalHydra

from ftjob.cli.main import precheck
from ftjob.config import JobConfig
from tests.support.jobs import compose_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def ftjob_args(command: str) -> list[str]:
    """The overrides of the ``python -m ftjob ...`` in ``command``."""
    words = shlex.split(command)
    at = words.index("ftjob")
    assert words[at - 1] == "-m", command
    return words[at + 1 :]


def check_command(args: list[str]) -> JobConfig:
    """As ``python -m ftjob`` checks a command before Ray starts (raises ConfigError); the job
    it runs."""
    try:
        precheck(args)
    finally:
        GlobalHydra.instance().clear()
    assert "+experiment=imagenet_ft" in args
    assert any(a.startswith("checkpoint.storage_path=s3://") for a in args), args
    assert not any(re.search(r"secret|key=|token", a, re.IGNORECASE) for a in args), args
    return compose_job(*args)


def check_rerun_continues(job: JobConfig, args: list[str], script: str) -> None:
    """A rerun of the same command continues the run: resume=auto, and a name that is the
    run's (fixed in the command, not made of the scheduler's job id or attempt)."""
    assert job.resume == "auto", args
    [name] = [a for a in args if a.startswith("name=")]
    assert re.fullmatch(r"name=[A-Za-z0-9._-]+", name), name
    assert job.name == name.removeprefix("name=")
    assert not re.search(r"name=\S*\$", script)  # no shell variable in it


def test_the_kuberay_rayjob_runs_a_valid_command_with_credentials_from_a_secret() -> None:
    text = (EXAMPLES / "kuberay" / "rayjob.yaml").read_text()
    job = yaml.safe_load(text)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    args = ftjob_args(job["spec"]["entrypoint"])
    check_rerun_continues(check_command(args), args, text)
    assert job["spec"]["backoffLimit"] >= 1  # KubeRay reruns a failed job on a new cluster
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"].startswith("2.60")
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        [container] = pod["template"]["spec"]["containers"]
        env: dict[str, Any] = {e["name"]: e for e in container["env"]}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert "value" not in env[name] and env[name]["valueFrom"]["secretKeyRef"]
        assert env["RAY_TRAIN_ENABLE_STATE_TRACKING"]["value"] == "1"


def test_the_slurm_script_runs_a_valid_command_with_credentials_from_the_environment() -> None:
    script = (EXAMPLES / "slurm" / "ftjob.sbatch").read_text()
    subprocess.run(["bash", "-n", "-c", script], check=True)  # it parses as bash
    joined = script.replace("\\\n", " ")
    [line] = [x for x in joined.splitlines() if x.strip().startswith("python -m ftjob")]
    # The shell's variables, as SLURM would give them.
    values = {"SLURM_JOB_ID": "4242", "head_ip": "10.0.0.1", "port": "6379"}
    line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line.rstrip(" &"))
    args = ftjob_args(line)
    check_rerun_continues(check_command(args), args, joined)
    assert "ray.address=10.0.0.1:6379" in args
    assert "#SBATCH --requeue" in script.splitlines()  # SLURM reruns it after a node failure
    assert not re.search(r"AWS_SECRET_ACCESS_KEY=\S", script)  # exported by the user, not here
    assert "#SBATCH --export=ALL" in script
