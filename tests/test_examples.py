"""The examples users copy. The deployment examples: KubeRay manifests (a RayJob with a cluster
of its own, a long-lived RayCluster and a RayJob that selects it) and a SLURM batch script. Each runs a valid
ftjob command (checked as ``python -m ftjob`` checks it before Ray starts), keeps its
checkpoints on S3 and takes credentials from outside (a service account's role, a Secret, the
environment), never inline; each lets its scheduler rerun the job after a driver's death with a
command that continues the run: resume=auto and a run name that stays the same. The manifests
use only field names KubeRay's and Kubernetes' APIs have, and every pod gives a stop the time
to commit a just-in-time checkpoint. The custom model and dataset example reads real image files
(written with PIL by tests/support/images.py) as uint8, to be normalised on the device."""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hydra.core.global_hydra import GlobalHydra
from PIL import Image

from ftjob.cli.main import precheck, spell_argv
from ftjob.config import ChaosKind, JobConfig, load_job
from ftjob.config.compose import Composer, Target
from ftjob.data.datasets import TRAIN, build_dataset
from tests.support.images import write_images
from tests.support.jobs import compose_job

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KUBERAY = EXAMPLES / "kuberay"

# Field names of the APIs the manifests are written against (KubeRay ray.io/v1, Kubernetes
# core/v1), those a manifest may use: a misspelt field is dropped by the API server in silence.
RAYJOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
    "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
    "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
    "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
}  # fmt: skip
RAYCLUSTER_SPEC = {
    "rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling",
    "autoscalerOptions", "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions",
    "authOptions",
}  # fmt: skip
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template",
    "numOfHosts", "idleTimeoutSeconds", "scaleStrategy", "suspend",
}  # fmt: skip
POD_SPEC = {
    "containers", "initContainers", "serviceAccountName", "imagePullSecrets",
    "terminationGracePeriodSeconds", "nodeSelector", "tolerations", "affinity", "volumes",
    "priorityClassName", "schedulerName", "securityContext", "restartPolicy",
}  # fmt: skip
CONTAINER = {
    "name", "image", "imagePullPolicy", "env", "envFrom", "resources", "lifecycle", "command",
    "args", "ports", "volumeMounts", "securityContext",
}  # fmt: skip
STATIC_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS")


def ftjob_args(command: str) -> list[str]:
    """The overrides of the ``python -m ftjob ...`` in ``command``."""
    words = shlex.split(command)
    at = words.index("ftjob")
    assert words[at - 1] == "-m", command
    return words[at + 1 :]


def check_command(args: list[str]) -> JobConfig:
    """As ``python -m ftjob`` checks a command before Ray starts (raises ConfigError); the job
    it runs: the ResNet-50 training job, no node kills, checkpoints on S3, no secret inline."""
    try:
        precheck(spell_argv(args))
    finally:
        GlobalHydra.instance().clear()
    assert "experiment=imagenet_resnet50" in args, args
    assert any(a.startswith("checkpoint.storage_path=s3://") for a in args), args
    assert not any(re.search(r"secret|key=|token", a, re.IGNORECASE) for a in args), args
    job = compose_job(*args)
    assert job.chaos.kind == ChaosKind.none
    return job


def check_rerun_continues(job: JobConfig, args: list[str], script: str) -> None:
    """A rerun of the same command continues the run: resume=auto, and a name that is the
    run's (fixed in the command, not made of the scheduler's job id or attempt)."""
    assert job.resume == "auto", args
    [name] = [a for a in args if a.startswith("name=")]
    assert re.fullmatch(r"name=[A-Za-z0-9._-]+", name), name
    assert job.name == name.removeprefix("name=")
    assert not re.search(r"name=\S*\$", script)  # no shell variable in it


def check_fields(node: dict[str, Any], known: set[str], where: str) -> None:
    unknown = set(node) - known
    assert not unknown, f"{where}: no such field {sorted(unknown)}"


def check_pod(group: dict[str, Any], where: str, gpu: bool) -> None:
    """A pod of a Ray cluster: known fields; a versioned image it may pull; storage through its
    service account, no static keys; the W&B key from a Secret; time to checkpoint on a stop,
    held by a preStop hook (the grace period starts with it, SIGTERM comes after it)."""
    spec = group["template"]["spec"]
    check_fields(spec, POD_SPEC, where)
    assert spec["serviceAccountName"] and spec["imagePullSecrets"][0]["name"], where
    [container] = spec["containers"]
    check_fields(container, CONTAINER, where)
    image, _, tag = container["image"].rpartition(":")
    assert image and tag and tag != "latest" and "/" not in tag, container["image"]
    env: dict[str, Any] = {e["name"]: e for e in container["env"]}
    assert not set(STATIC_KEYS) & set(env), where
    assert "value" not in env["WANDB_API_KEY"] and env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert env["RAY_TRAIN_ENABLE_STATE_TRACKING"]["value"] == "1"
    stop_wait = float(env["RAY_JOB_STOP_WAIT_TIME_S"]["value"])
    assert spec["terminationGracePeriodSeconds"] > stop_wait >= 60, where
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["python", "-c"], hook
    compile(hook[2], f"{where} preStop", "exec")  # the hook's program parses
    if gpu:
        assert container["resources"]["limits"]["nvidia.com/gpu"]
        assert spec["nodeSelector"] and spec["tolerations"], where
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]), where


def check_cluster(cluster: dict[str, Any], where: str) -> None:
    check_fields(cluster, RAYCLUSTER_SPEC, where)
    assert cluster["rayVersion"].startswith("2.60")
    check_fields(cluster["headGroupSpec"], HEAD_GROUP, f"{where} head")
    check_pod(cluster["headGroupSpec"], f"{where} head", gpu=False)
    for group in cluster["workerGroupSpecs"]:
        check_fields(group, WORKER_GROUP, f"{where} {group['groupName']}")
        check_pod(group, f"{where} {group['groupName']}", gpu=True)


def check_rayjob(job: dict[str, Any], text: str) -> None:
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    check_fields(job["spec"], RAYJOB_SPEC, job["metadata"]["name"])
    args = ftjob_args(job["spec"]["entrypoint"])
    check_rerun_continues(check_command(args), args, text)
    runtime = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert float(runtime["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60
    # W&B's key comes from a Secret in the pods' environment, never with the job.
    assert "WANDB_API_KEY" not in job["spec"]["entrypoint"] + job["spec"]["runtimeEnvYAML"]


def test_the_rayjob_brings_a_complete_cluster_and_reruns_a_valid_command() -> None:
    text = (KUBERAY / "rayjob.yaml").read_text()
    job = yaml.safe_load(text)
    check_rayjob(job, text)
    assert job["spec"]["backoffLimit"] >= 1  # KubeRay reruns a failed job on a new cluster
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    check_cluster(job["spec"]["rayClusterSpec"], "rayjob.yaml")
    # How to stop it so that it checkpoints: the Ray job first, then the RayJob.
    commands = [line.lstrip("# ") for line in text.splitlines() if line.startswith("#   ")]
    stop = next(
        i for i, c in enumerate(commands) if c.startswith("kubectl exec") and "ray job stop" in c
    )
    assert commands[stop + 1] == f"kubectl delete rayjob {job['metadata']['name']}", commands


def test_the_long_lived_cluster_and_the_rayjob_that_selects_it() -> None:
    cluster = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    check_cluster(cluster["spec"], "raycluster.yaml")
    text = (KUBERAY / "rayjob-on-cluster.yaml").read_text()
    job = yaml.safe_load(text)
    check_rayjob(job, text)
    assert "rayClusterSpec" not in job["spec"]
    # clusterSelector picks the cluster by a label the RayCluster carries.
    selector = job["spec"]["clusterSelector"]
    assert selector == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert selector.items() <= cluster["metadata"]["labels"].items()


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
    lines = script.splitlines()
    assert "#SBATCH --requeue" in lines  # SLURM reruns it after a node failure
    assert not re.search(r"AWS_SECRET_ACCESS_KEY=\S", script)  # exported by the user, not here
    assert "#SBATCH --export=ALL" in lines
    # A stop that reaches the driver alone (the Ray nodes live through its checkpoint), and
    # the cluster waited for by asking it, not by sleeping a guess.
    assert "scancel --batch --signal=TERM" in script
    assert "trap 'kill -TERM \"$driver\"' TERM" in script
    sleeps = [x.strip() for x in lines if re.match(r"\s*sleep\b", x)]
    assert sleeps == ["sleep 1"], sleeps
    poll = script[: script.index("sleep 1")].rsplit("for ", 1)[1]
    assert "ray status" in poll, poll


def files_with_csv(root: Path) -> dict[str, list[Path]]:
    """write_images' two classes of 8x8 PNGs (folders a and b), listed the way the custom
    example's dataset reads them: a CSV per split of ``file,label`` (a label is a name)."""
    write_images(root)
    listed: dict[str, list[Path]] = {}
    for split in (TRAIN, "val"):
        files = sorted((root / split).glob("*/*.png"))
        with open(root / f"{split}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["file", "label"])
            for path in files:
                label = "horizontal" if path.parent.name == "a" else "vertical"
                out.writerow([path.relative_to(root).as_posix(), label])
        listed[split] = files
    return listed


def test_the_custom_dataset_reads_its_image_files_as_uint8_with_a_normalisation(
    tmp_path: Path, monkeypatch
) -> None:
    example = EXAMPLES / "custom_model_dataset"
    monkeypatch.syspath_prepend(str(example))
    root = tmp_path / "bars"
    listed = files_with_csv(root)
    overrides = ["experiment=bars_ft", f"dataset.root={root}", "dataset.image_size=8"]
    try:  # as its README's command composes it, from its own config dir
        job = load_job(Composer(str(example / "conf")).compose(Target("example"), overrides))
    finally:
        GlobalHydra.instance().clear()
    dataset = build_dataset(job.dataset)
    assert dataset.num_classes == 2
    train = dataset.catalog(TRAIN)
    assert train.column("path").to_pylist() == [str(p) for p in listed[TRAIN]]
    assert train.column("label").to_pylist() == [0] * 23 + [1] * 23  # a: horizontal, b: vertical
    val = dataset.catalog("val")
    rows = {name: val.column(name).to_numpy(zero_copy_only=False) for name in val.column_names}
    images = dataset.decode(rows, "val", 0, 0)
    # The files' own pixels, NCHW uint8 -- normalised on the device with the dataset's figures.
    assert images.dtype == np.uint8 and images.shape == (len(listed["val"]), 3, 8, 8)
    for image, path in zip(images, listed["val"], strict=True):
        pixels = np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(image, pixels), path
    assert dataset.normalisation() == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
