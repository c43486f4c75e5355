"""Schema rules and composition (no Ray): every rule names the key, the value and the rule."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from ftjob.cli.main import precheck
from ftjob.config import (
    RENAMED_FAILURE_KEYS,
    WORKER_KINDS,
    ChaosConfig,
    ChaosKind,
    CheckpointConfig,
    Choice,
    ConfigError,
    FailureConfig,
    JobConfig,
    JobError,
    LoggerConfig,
    RayConfig,
    RetryConfig,
    TrainerConfig,
    register_schema,
    to_plain,
)
from tests.support.images import make_image_tree
from tests.support.jobs import compose_job
from tests.support.processes import ctrl_c_reaches_it, ray_temp_dir

REPO = Path(__file__).resolve().parents[3]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _schema():
    register_schema()
    yield
    GlobalHydra.instance().clear()


def test_default_config_composes_to_a_runnable_job():
    job = compose_job()
    assert job.model["_target_"] == "ftjob.models.SmallCNN"
    assert job.dataset["_target_"] == "ftjob.datasets.DigitsDataset"
    assert job.chaos.kind == "none" and job.ray.address is None and job.name is None


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    overrides = [f"+experiment={experiment}"]
    if experiment.startswith("imagenet"):  # needs data and storage on a cluster
        overrides += ["dataset.path=/data/imagenet", "checkpoint.storage_path=s3://b/ftjob"]
    job = compose_job(*overrides)
    assert job.trainer.num_workers >= 1
    assert job.failure.max_failures >= 4


def test_the_resnet50_recipe_trains_as_imagenet_recipes_do():
    job = compose_job(
        "+experiment=imagenet_resnet50",
        "dataset.path=s3://b/imagenet",
        "checkpoint.storage_path=s3://b/c",
    )
    t = job.trainer
    assert job.model["_target_"] == "torchvision.models.resnet50"
    assert (t.epochs, t.lr_schedule, t.warmup_epochs, t.label_smoothing) == (90, "cosine", 5, 0.1)
    assert t.lr * t.global_batch_size / t.lr_reference_batch == pytest.approx(0.4)
    assert not t.weight_decay_norm_and_bias and t.precision == "bf16" and t.channels_last
    assert job.optimizer["_target_"] == "torch.optim.SGD" and job.optimizer["weight_decay"] == 1e-4


def test_imagenet_ft_is_the_seed_benchmark_job():
    job = compose_job(
        "+experiment=imagenet_ft",
        "dataset.path=s3://b/imagenet",
        "checkpoint.storage_path=s3://b/c",
    )
    assert job.ray.address == "auto"
    assert job.model["_target_"] == "torchvision.models.resnet50"
    assert job.dataset["num_classes"] == 1000
    assert job.trainer.use_gpu and job.trainer.validate_every_n_steps > 0
    assert (job.chaos.kind, job.chaos.interval, job.chaos.max_kills) == ("node", 480.0, 2)
    assert job.chaos.allow_on_existing_cluster  # reviewed config that opts in to node kills


def test_a_cluster_job_needs_checkpoint_storage_every_node_reaches():
    with pytest.raises(ConfigError) as err:
        compose_job("+experiment=imagenet_ft", "dataset.path=s3://b/imagenet")
    assert err.value.key == "checkpoint.storage_path" and err.value.supply
    assert "s3://" in err.value.rule and "shared_filesystem=true" in err.value.rule
    with pytest.raises(ConfigError, match="mounted on every node"):
        compose_job("ray.address=10.0.0.1:6379", "checkpoint.storage_path=/scratch/ck")
    shared = compose_job(
        "ray.address=10.0.0.1:6379",
        "checkpoint.storage_path=/nfs/ck",
        "checkpoint.shared_filesystem=true",
    )
    assert shared.checkpoint.storage_path == "/nfs/ck"
    assert compose_job("ray.local_nodes=3").checkpoint.storage_path is None  # one machine


def test_imagenet_ft_without_path_names_dataset_path():
    with pytest.raises(ConfigError) as err:
        compose_job("+experiment=imagenet_ft")
    assert err.value.key == "dataset.path"
    assert "dataset.path=" in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ("chaos.interval=-5", "chaos.interval"),
        ("trainer.num_workers=-1", "trainer.num_workers"),
        ("checkpoint.retry.max_attempts=0", "checkpoint.retry.max_attempts"),
        ("checkpoint.memory.every_n_steps=0", "checkpoint.memory.every_n_steps"),
        ("checkpoint.memory.every_n_steps=often", "checkpoint.memory.every_n_steps"),
        ("checkpoint.memory.every_n_steps=2.5", "checkpoint.memory.every_n_steps"),
        ("checkpoint.memory.max_overhead=0", "checkpoint.memory.max_overhead"),
        ("checkpoint.memory.max_overhead=1.5", "checkpoint.memory.max_overhead"),
        ("trainer.num_wrkers=2", "trainer.num_wrkers"),
        ("trainer.num_workers=abc", "trainer.num_workers"),
        ("+trainer.extra=1", "trainer.extra"),
        ("chaos.storage.failure_rate=1.5", "chaos.storage.failure_rate"),
        ("chaos.storage.errors=[flood]", "chaos.storage.errors"),
        ("checkpoint.upload_mode=later", "checkpoint.upload_mode"),
        ("optimizer=lbfgs", "optimizer"),
        ("model=nope", "model"),
        ("resume=true", "resume"),
        ("chaos=node_killer", "chaos.kind"),
        ("model.widht=8", "model.widht"),
        ("+model.widht=8", "model.widht"),
        ("+dataset.path=/x", "dataset.path"),
        ("+trainer.resources_per_worker.GPU=1", "trainer.resources_per_worker"),
        ('checkpoint.retry.retry_on=["("]', "checkpoint.retry.retry_on"),
        ("model._target_=torch.nn.Flatten", "model._target_"),
        ("checkpoint.storage_path=gs://bucket/ck", "checkpoint.storage_path"),
        ("checkpoint.storage_path=nosuch://bucket/ck", "checkpoint.storage_path"),
        ("dataset.image_size=4", "dataset.image_size"),
        ("trainer.placement=STRICT", "trainer.placement"),
        ("trainer.decode_in=gpu", "trainer.decode_in"),
        ("chaos.at_steps=[10]", "chaos.at_steps"),
        ("ray.object_pull_timeout_ms=0", "ray.object_pull_timeout_ms"),
        ("ray.health_check_period_ms=50", "ray.health_check_period_ms"),
        ("ray.health_check_failure_threshold=0", "ray.health_check_failure_threshold"),
        ("ray.replace_after_steps=0", "ray.replace_after_steps"),
        ("ray.replace_after_steps=3", "ray.replace_after_steps"),  # a fixed-size group
        ("name=..", "name"),
        ("name=.", "name"),
        ("name=.hidden", "name"),
        ("name='exp[1]'", "name"),
        ("name='exp*'", "name"),
        ("name='exp?'", "name"),
        ("name=a/b", "name"),
        ("name=" + "x" * 129, "name"),
    ],
)
def test_bad_input_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        precheck([override])
    assert err.value.key == key
    assert "\n" not in str(err.value)


def _float_keys(schema: type, prefix: str = "") -> list[str]:
    """Every number key of the schema that takes a float (``dict[str, float]``: one entry)."""
    hints, found = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            found += _float_keys(kind, f"{prefix}{f.name}.")
        elif kind == dict[str, float]:
            found.append(f"{prefix}{f.name}.CPU")
        elif float in (kind, *typing.get_args(kind)):
            found.append(f"{prefix}{f.name}")
    return found


FLOAT_KEYS = _float_keys(JobConfig)


@pytest.mark.parametrize("value", ["inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_no_number_key_takes_a_non_finite_value(key, value):
    with pytest.raises(ConfigError) as err:
        precheck([f"{key}={value}"])
    old = key.removeprefix("failure.")
    named = f"failure.{RENAMED_FAILURE_KEYS[old]}" if old in RENAMED_FAILURE_KEYS else key
    assert err.value.key == named and "\n" not in str(err.value)


# Every key typed with a Choice, and a word it does not take.
CHOICE_KEYS = {
    "chaos.kind": "nod",
    "chaos.target": "rank1",
    "checkpoint.upload_mode": "later",
    "trainer.lr_schedule": "step",
    "trainer.precision": "fp16",
    "trainer.decode_in": "gpu",
    "trainer.placement": "STRICT",
    "failure.straggler.action": "kill",
    "failure.straggler_action": "kill",
    "logger.wandb_mode": "sometimes",
}


def _choice_keys(schema: type, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(schema)
    found: set[str] = set()
    for f in dataclasses.fields(schema):
        kinds = [hints[f.name], *typing.get_args(hints[f.name])]
        if dataclasses.is_dataclass(hints[f.name]):
            found |= _choice_keys(hints[f.name], f"{prefix}{f.name}.")
        elif any(isinstance(k, type) and issubclass(k, Choice) for k in kinds):
            found.add(f"{prefix}{f.name}")
    return found


def test_every_choice_key_is_tested():
    assert _choice_keys(JobConfig) == set(CHOICE_KEYS)


@pytest.mark.parametrize("key", sorted(CHOICE_KEYS))
def test_a_word_a_choice_key_does_not_take_is_refused_at_composition(key, tmp_path):
    word = CHOICE_KEYS[key]
    with pytest.raises(ConfigError) as err:  # on the command line
        precheck([f"{key}={word}"])
    assert (err.value.key, err.value.value) == (key, word) and "\n" not in str(err.value)
    assert f"'{word}'" in err.value.rule and "expected one of [" in err.value.rule
    (tmp_path / "experiment").mkdir()
    written = OmegaConf.to_yaml(OmegaConf.from_dotlist([f"{key}={word}"]))
    (tmp_path / "experiment" / "bad.yaml").write_text(f"# @package _global_\n{written}")
    with pytest.raises(ConfigError) as err:  # in a config file
        precheck(["--config-dir", str(tmp_path), "+experiment=bad"])
    assert (err.value.key, err.value.value) == (key, word)


def test_a_choice_is_its_word_wherever_it_goes():
    job = compose_job("chaos.kind=worker", "trainer.precision=bf16", "checkpoint.upload_mode=async")
    kind = job.chaos.kind
    assert isinstance(kind, ChaosKind) and kind == "worker" and kind in WORKER_KINDS
    assert str(kind) == f"{kind}" == format(kind) == "worker"
    assert repr(kind) == "'worker'"  # as a message shows a value
    assert {kind: 1}["worker"] == 1
    plain = to_plain(job)
    written = json.loads(json.dumps(plain))
    assert (written["chaos"]["kind"], written["trainer"]["precision"]) == ("worker", "bf16")
    assert type(plain["chaos"]["kind"]) is str and type(plain["checkpoint"]["upload_mode"]) is str


def test_a_config_built_in_python_takes_plain_words_and_refuses_others():
    assert ChaosConfig(kind="node").kind is ChaosKind.node
    assert TrainerConfig(placement=None).placement is None
    with pytest.raises(ConfigError) as err:
        TrainerConfig(precision="fp16")
    assert str(err.value) == "trainer.precision='fp16': must be one of ['fp32', 'bf16']"


def test_building_a_job_imports_no_target_loading_it_does():
    job = JobConfig(model={"_target_": "no_such_module.Net"}, dataset={"_target_": "x.Y"})
    assert job.model["_target_"] == "no_such_module.Net"  # built: nothing imported
    with pytest.raises(ConfigError) as err:
        compose_job("model._target_=no_such_module.Net")
    assert err.value.key == "model._target_" and "cannot be imported" in err.value.rule


def test_the_keys_that_failed_late_on_inf_are_among_those_checked():
    named = {
        "checkpoint.lease_timeout",
        "checkpoint.memory.max_mb",
        "checkpoint.retry.deadline",
        "trainer.resources_per_worker.CPU",
    }
    assert named <= set(FLOAT_KEYS) and len(FLOAT_KEYS) > 30


@pytest.mark.parametrize(
    "overrides, key, rule",
    [
        (["dataset.image_size=0"], "dataset.image_size", "must be >= 1 pixel"),
        (["dataset.mean=[0.5]"], "dataset.mean", "3 values"),
        (["dataset.std=[0.5,0,0.5]"], "dataset.std", "> 0"),
        (["dataset.resize_size=8"], "dataset.resize_size", "must be >= dataset.image_size"),
        (["dataset.bad_files=ignore"], "dataset.bad_files", "must be fail (a file that does"),
        (["dataset.max_image_pixels=0"], "dataset.max_image_pixels", "whole number of pixels"),
        (["dataset.max_image_pixels=1e9"], "dataset.max_image_pixels", "or null for no limit"),
    ],
)
def test_dataset_values_that_would_fail_in_decode_tasks_are_refused_first(overrides, key, rule):
    with pytest.raises(ConfigError) as err:
        precheck(["dataset=imagefolder", "dataset.path=/data/images", *overrides])
    assert err.value.key == key and rule in err.value.rule


def test_node_chaos_on_a_cluster_ftjob_did_not_start_needs_an_explicit_opt_in():
    cluster = ["ray.address=10.0.0.1:6379", "checkpoint.storage_path=s3://bucket/ck"]
    for chaos in ("chaos=node_killer", "chaos=preempt"):
        with pytest.raises(ConfigError) as err:
            precheck([*cluster, chaos])
        assert err.value.key == "chaos.allow_on_existing_cluster"
        assert "every other job's work" in err.value.rule
        precheck([*cluster, chaos, "chaos.allow_on_existing_cluster=true"])
    precheck([*cluster, "chaos=worker_killer"])  # only ftjob's own workers: no opt-in
    with pytest.raises(ConfigError) as err:  # a mix that takes nodes: the same opt-in
        precheck([*cluster, "chaos=mixed", "chaos.mix=[worker,preempt]"])
    assert err.value.key == "chaos.allow_on_existing_cluster"
    precheck([*cluster, "chaos=mixed", "chaos.mix=[worker,slow]"])


def test_a_mixed_chaos_needs_what_each_of_its_kinds_needs():
    with pytest.raises(ConfigError) as err:  # node kills without nodes to take
        precheck(["chaos=mixed", "chaos.mix=[worker,node]"])
    assert err.value.key == "chaos.kind" and "takes nodes away" in err.value.rule
    with pytest.raises(ConfigError) as err:  # a hang that nothing would end
        precheck(["chaos=mixed", "chaos.mix=[hang]", "failure.hang.enabled=false"])
    assert err.value.key == "failure.hang.enabled"
    with pytest.raises(ConfigError) as err:
        precheck(["chaos=mixed", "chaos.mix=[worker,explode]"])
    assert err.value.key == "chaos.mix"
    precheck(["chaos=mixed", "ray.local_nodes=3"])


def test_a_run_name_that_climbs_out_exits_2_before_ray_and_touches_nothing(tmp_path):
    tmp = tmp_path / "tmp"
    (tmp / "ftjob-scratch").mkdir(parents=True)
    canary = tmp / "someone-elses-file"
    canary.write_text("keep me")
    ray_env, ray_started = ray_temp_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ftjob", "name=.."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(tmp), **ray_env},
    )
    assert proc.returncode == 2 and not ray_started.exists()  # refused before Ray started
    assert "name='..'" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert canary.read_text() == "keep me" and (tmp / "ftjob-scratch").is_dir()
    assert not (tmp_path / "outputs").exists()


def test_a_missing_option_lists_the_options_that_exist():
    with pytest.raises(ConfigError) as err:
        precheck(["model=resnet99"])
    assert err.value.rule == "no such model option; the options are: resnet18, resnet50, small_cnn"


def test_a_storage_backend_that_is_not_installed_names_what_to_install():
    with pytest.raises(ConfigError) as err:
        precheck(["checkpoint.storage_path=gs://bucket/ck"])
    assert "pip install 'ftjob[gcs]'" in err.value.rule


def test_sweep_values_are_all_checked_before_any_job():
    precheck(["-m", "chaos.interval=10,20"])
    with pytest.raises(ConfigError) as err:
        precheck(["-m", "chaos.interval=10,-1"])
    assert err.value.key == "chaos.interval" and err.value.value == -1.0


def test_value_rules_in_dataclasses():
    with pytest.raises(ConfigError, match="checkpoint.retry.max_backoff"):
        RetryConfig(initial_backoff=5, max_backoff=1)
    with pytest.raises(ConfigError, match="chaos.fail_at_steps"):
        ChaosConfig(fail_at_steps=[0])
    with pytest.raises(ConfigError, match="trainer.lr"):
        TrainerConfig(lr=float("nan"))


def test_cli_refuses_bad_override_fast_with_one_line(tmp_path):
    ray_env, ray_started = ray_temp_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "ftjob", "trainer.num_wrkers=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **ray_env},
    )
    assert proc.returncode == 2
    assert not ray_started.exists()  # refused before Ray started
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.num_wrkers" in lines[0]
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run dir


def test_a_gpu_job_on_a_machine_without_gpus_is_refused_before_ray_starts(tmp_path, monkeypatch):
    import torch

    from ftjob.driver.cluster import check_local_gpus
    from ftjob.driver.runner import prepare

    gpus = 0
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # this machine, as torch sees it
    images = make_image_tree(tmp_path / "images", classes=2, train_per_class=4, val_per_class=2)

    def job(*overrides: str) -> Any:
        return compose_job(
            "+experiment=imagenet_ft",
            f"dataset.path={images}",
            "chaos=disabled",
            "ray.address=null",  # a cluster ftjob starts on this machine
            "trainer.num_workers=2",
            *overrides,
        )

    refused = r"needs 2 GPUs but this machine \(where ftjob starts the cluster\) has 0: set trainer\.use_gpu=false"
    for cluster in ("ray.local_nodes=1", "ray.local_nodes=3"):  # embedded, simulated
        with pytest.raises(JobError, match=refused):
            prepare(job(cluster), str(tmp_path / "run"))
        assert not (tmp_path / "run").exists()  # refused first: no lease, no checkpoints dir
    check_local_gpus(job("trainer.use_gpu=false", "~trainer.resources_per_worker.GPU"))
    check_local_gpus(
        job("ray.address=auto", "checkpoint.storage_path=s3://bucket/runs")
    )  # an existing cluster: asked of Ray
    gpus = 1
    check_local_gpus(job())  # 2 workers on 1 GPU: Ray's resource check says so, once started


def _ftjob(args: list[str], tmp_path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ftjob", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        preexec_fn=ctrl_c_reaches_it,
    )


@pytest.mark.parametrize(
    ("sig", "code", "status", "said"),
    [
        (signal.SIGINT, 130, "interrupted", "interrupted (Ctrl-C)"),
        (signal.SIGTERM, 143, "preempted", "stopped by a preemption notice (SIGTERM)"),
    ],
)
def test_a_run_stopped_while_the_dataset_is_listed_ends_with_a_summary(
    tmp_path, sig, code, status, said
):
    mark = tmp_path / "listing"
    proc = _ftjob(
        ["dataset._target_=tests.support.cli_datasets.SlowListingDataset"],
        tmp_path,
        FTJOB_TEST_LISTING_MARK=str(mark),
    )
    deadline = time.monotonic() + 60
    while not mark.exists():  # past start-up, into the minute-long listing
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == code
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == status
    assert summary["error"] == (
        f"{said} during start-up (checking the storage, the resume target and the dataset), "
        "before the first step"
    )
    assert "summary: " in stdout


def test_an_unexpected_error_exits_1_with_a_summary_and_its_traceback_kept(tmp_path):
    proc = _ftjob(["dataset._target_=tests.support.cli_datasets.BuggyDataset"], tmp_path)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftjob: error: KeyError: 'no such key'")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "KeyError: 'no such key'"
    assert "cli_datasets.py" in (tmp_path / "run" / "traceback.txt").read_text()


def test_config_dir_from_an_installed_wheel_elsewhere(tmp_path):
    """conf/ ships inside the package: Hydra finds it from any directory, without the repo."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    wheel = next(wheel_dir.glob("ftjob-*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "ftjob", "+experiment=digits_ft", "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint_every_n_steps: 10" in proc.stdout
    loaded = subprocess.run(
        [sys.executable, "-c", "import ftjob, sys; print(ftjob.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert loaded.stdout.startswith(str(target))


def test_sweep_preset_values_are_checked_with_or_without_dash_m():
    precheck(["+experiment=digits_ft", "+sweep=kill_interval"])
    precheck(["+experiment=digits_ft", "+sweep=kill_interval", "chaos.interval=5,10"])
    with pytest.raises(ConfigError) as err:
        precheck(["+experiment=digits_ft", "+sweep=kill_interval", "chaos.interval=5,-3"])
    assert err.value.key == "chaos.interval"


def test_user_primary_config_in_config_dir(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - config\n  - _self_\ntrainer:\n  epochs: 2\n"
    )
    precheck(["--config-dir", str(tmp_path), "--config-name", "mine"])
    (tmp_path / "bad.yaml").write_text("defaults:\n  - config\n  - _self_\ntrainer:\n  epochs: 0\n")
    with pytest.raises(ConfigError, match="trainer.epochs"):
        precheck(["--config-dir", str(tmp_path), "--config-name", "bad"])


# One home per default and per doc: the default option files hold what users choose, with the
# schema's defaults; the tuning keys they leave out are documented in docs/config.md.
DEFAULT_OPTIONS = {
    "trainer": ("default", TrainerConfig),
    "checkpoint": ("default", CheckpointConfig),
    "failure": ("default", FailureConfig),
    "ray": ("local", RayConfig),
    "chaos": ("disabled", ChaosConfig),
    "logger": ("none", LoggerConfig),
}


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        found: dict[str, Any] = {}
        for key, value in node.items():
            found.update(leaves(value, f"{prefix}.{key}" if prefix else key))
        return found
    return {prefix: node}


@pytest.mark.parametrize("group", sorted(DEFAULT_OPTIONS))
def test_default_option_files_hold_the_schemas_defaults(group: str):
    option, schema = DEFAULT_OPTIONS[group]
    written = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / group / f"{option}.yaml"))
    written.pop("defaults", None)
    defaults = OmegaConf.to_container(OmegaConf.structured(schema()))
    wrong = {
        key: (value, leaves(defaults).get(key, "not in the schema"))
        for key, value in leaves(written).items()
        if leaves(defaults).get(key, "not in the schema") != value
    }
    assert not wrong, f"conf/{group}/{option}.yaml disagrees with {schema.__name__}: {wrong}"


def test_every_key_the_option_files_leave_out_is_documented_in_the_config_reference():
    reference = (REPO / "docs" / "config.md").read_text()
    renamed = {f"failure.{old}" for old in RENAMED_FAILURE_KEYS}
    undocumented = []
    for group, (option, schema) in DEFAULT_OPTIONS.items():
        written = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / group / f"{option}.yaml"))
        shown = {f"{group}.{key}" for key in leaves(written)}
        for key in leaves(OmegaConf.to_container(OmegaConf.structured(schema())), group):
            if key not in shown and key not in renamed and f"`{key}`" not in reference:
                undocumented.append(key)
    assert not undocumented, f"schema keys with no home for their doc: {undocumented}"
