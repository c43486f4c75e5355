"""One training run with its checkpoints on a real S3 API (moto's server on loopback,
tests/support/s3_fixtures.py) through a fault-injecting proxy (tests/support/fault_proxy.py):
a failure and a drain notice on a simulated cluster, training on Parquet shards in the same
bucket."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from ftjob import metrics as M
from ftjob.data.to_parquet import convert
from tests.support.fault_proxy import FaultProxy
from tests.support.images import digits_tree
from tests.support.loggers import check_loggers
from tests.support.processes import run_ftjob
from tests.support.s3 import (
    fresh_s3fs,  # noqa: F401 -- autouse: a clean s3fs cache per test
    s3_keys,
    s3_store,
)
from tests.support.summaries import exactly_once

pytestmark = pytest.mark.s3


@pytest.mark.ray
def test_training_on_s3_through_faults_a_failure_and_a_drain_notice(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run on a simulated 3-node cluster, checkpoints on S3 through a network that
    throttles and drops: a failure restored from S3; a node drained with notice (Ray's drain
    API, as a spot reclaim) during an upload, whose checkpoint becomes the just-in-time one (no
    step lost, no failure budget spent); every checkpoint committed; no secret (in
    storage_options, or from the environment) in anything the run wrote; every logger's record
    of the run (one point per step across the restores), read back; each sample trained once.
    The data: the digits run's images (its train/val rows, as PNGs) written by ftjob's writer
    as Parquet shards into the bucket (``dataset=parquet``), read over S3 by Ray Data's decode
    tasks through the failure and the drain."""
    shards = f"s3://{s3_bucket}/digits"
    options = {"endpoint_url": s3_endpoint}
    convert(str(digits_tree(tmp_path / "digits")), shards, 256, storage_options=options)
    # About a third of the requests fail (truncation hits only reads): every one of the run's
    # ~15 uploads goes through the proxy, so none retried would be a 1-in-600 run (0.65^15).
    faults = {"throttle_rate": 0.2, "drop_rate": 0.15, "truncate_rate": 0.06}
    secret, from_env = "s3-secret-6f1c9d2a", "env-token-0b7e44c1"
    with FaultProxy(s3_endpoint, seed=3, **faults) as proxy:
        proc, summary = run_ftjob(
            [
                "+experiment=digits_ft",
                "dataset=parquet",  # the digits' 1438 + 359 rows in 6 + 2 shards
                f"dataset.path={shards}",
                f"+dataset.storage_options.endpoint_url={s3_endpoint}",
                "dataset.image_size=32",  # as dataset=digits renders them
                "dataset.resize_size=32",
                "dataset.augment=false",
                "dataset.num_classes=10",
                "trainer.epochs=2",  # 22 steps an epoch: checkpoints at 22, 30, 44
                "trainer.checkpoint_every_n_steps=30",
                "trainer.audit_samples=true",
                "chaos.fail_at_steps=[25]",
                "checkpoint.memory.enabled=false",  # the failure restores from S3
                "failure.max_failures=1",  # the failure's; the notice must not need one
                # The notice comes while step 30's checkpoint uploads: every upload request
                # takes 1 s more (5 files), longer than a notice takes to arrive (the killer's
                # poll, then the drain relay's, ~1.5 s). The ranks hear it once that upload is
                # committed (6+ s through a third of requests failing, and a busy machine):
                # its 30 s give the commit room to end well before the node goes.
                "ray.local_nodes=3",
                # The drained node's replacement is added as it goes (at the deadline, not 5 s
                # later): the restart waits for it, and nothing here is about that wait.
                "ray.replace_delay=0",
                "trainer.decode_in=ray",  # Ray Data's decode through a failure and a drain
                "chaos=preempt",
                "chaos.at_steps=[30]",
                "chaos.notice=30",
                "chaos.storage.upload_delay=1.0",
                f"checkpoint.storage_path=s3://{s3_bucket}/runs",
                f"+checkpoint.storage_options.endpoint_url={proxy.url}",
                "checkpoint.retry.max_attempts=12",
                "checkpoint.retry.initial_backoff=0.05",
                "checkpoint.retry.max_backoff=0.5",
                "name=s3-e2e",
                "+checkpoint.storage_options.key=AKIAIOSFODNN7EXAMPLE",
                f"+checkpoint.storage_options.secret={secret}",
                "+ray.runtime_env.env_vars.FTJOB_TEST_TOKEN=${oc.env:FTJOB_SECRET_FROM_ENV}",
                "logger=many",
            ],
            tmp_path,
            timeout=600,
            env={"FTJOB_SECRET_FROM_ENV": from_env, "WANDB_MODE": "offline"},
        )
        served = proxy.snapshot()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert summary is not None and summary["status"] == "succeeded", summary and summary["error"]
    metrics = summary["metrics"]
    assert metrics["checkpoint/upload_failures"] == 0
    assert metrics["checkpoint/upload_retries"] > 0
    assert summary["checkpoints"]["committed"] == 3 and summary["checkpoints"]["failed"] == 0
    assert served["throttle"] > 0 and served["drop"] > 0, served
    failure, preemption = summary["failures"]
    # The failure at step 25 was recovered from the checkpoint of step 22, read from S3.
    assert failure["recovered"] and failure["restored_step"] == 22
    assert failure["download_s"] > 0
    assert failure["checkpoint"] == f"{s3_bucket}/runs/s3-e2e/checkpoints/step_000000022"
    # The drain notice came during the upload of step 30: that upload became the JIT one.
    assert preemption["kind"] == "preemption" and preemption["recovered"]
    notice = preemption["notice"]
    assert notice["source"] == "drain" and notice["step"] == 30
    assert notice["deadline"] > notice["received"] and preemption["time"] == notice["deadline"]
    assert preemption["lost_steps"] == 0 and preemption["jit"]["reused"]
    assert preemption["restored_step"] == preemption["jit"]["step"] == 30
    assert preemption["time_to_recover_s"] > 0
    assert (metrics[M.PREEMPTION_COUNT], metrics[M.FAILURES_COUNT]) == (1, 1)
    assert metrics[M.PREEMPTION_LOST_STEPS] == 0 and metrics[M.PREEMPTION_JIT_CHECKPOINT_TIME] > 0
    # The node went; it may still await Ray's death notice when the run ends.
    [drained] = summary["chaos"]["kills"] + summary["chaos"]["skipped"]
    assert drained["kind"] == "preempt"
    assert drained.get("confirmed") or "before the run ended" in drained["reason"]
    assert "preemption notice (drain)" in proc.stdout
    assert len(summary["audit"]) == 2 and all(exactly_once(a) for a in summary["audit"])
    assert all(a["unique"] == 22 * 64 for a in summary["audit"])
    # Two epochs of digits learn them on the Parquet layout as on dataset=digits.
    assert metrics["validation/accuracy"] >= 0.8, metrics["validation/accuracy"]
    # The bucket holds the newest committed checkpoints (checkpoint.num_to_keep=2), complete.
    keys = s3_keys(s3_endpoint, s3_bucket, "runs/s3-e2e/checkpoints/")
    kept = sorted({k.split("/")[3] for k in keys})
    assert kept == ["step_000000030", "step_000000044"]
    direct = s3_store(f"s3://{s3_bucket}/runs/s3-e2e", s3_endpoint)
    for step in (30, 44):
        assert direct.download(step, str(tmp_path / "verify" / str(step)))["step"] == step
    # Secrets: in nothing under the run dir (summary, .hydra/, loggers), the checkpoint dir,
    # or the console.
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    stored = [
        client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        for key in s3_keys(s3_endpoint, s3_bucket, "runs/")
    ]
    written = [p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(stored) > 5 and len(written) > 5
    for value in (secret, from_env):
        assert not any(value.encode() in blob for blob in stored + written), value
        assert value not in proc.stdout + proc.stderr
    assert summary["config"]["checkpoint"]["storage_options"]["secret"] == "<redacted>"
    # The run's outputs outlive the driver's machine: mirrored beside its checkpoints (through
    # the same faulty network), the summary as the run dir holds it; the loggers' run ids too.
    assert f"outputs: s3://{s3_bucket}/runs/s3-e2e/outputs" in proc.stdout
    mirrored = s3_keys(s3_endpoint, s3_bucket, "runs/s3-e2e/outputs/")
    for name in ("summary.json", "console.log", "timeline.png", ".hydra/overrides.yaml"):
        assert f"runs/s3-e2e/outputs/{name}" in mirrored, mirrored
    key = "runs/s3-e2e/outputs/summary.json"
    assert json.loads(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()) == summary
    assert "runs/s3-e2e/loggers.json" in s3_keys(s3_endpoint, s3_bucket, "runs/s3-e2e/")
    check_loggers(tmp_path / "run", "s3-e2e", monkeypatch, last_step=44, epochs=2, failures=1)
