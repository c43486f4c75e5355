"""Secrets stay secret: configs, overrides, the resume command and text are redacted."""

from __future__ import annotations

from omegaconf import OmegaConf

from ftjob.reporting.redact import REDACTED, Redactor, env_sources, is_secret_key, redact_url


def test_credential_keys_are_recognised_and_ordinary_keys_are_not() -> None:
    for key in (
        "checkpoint.storage_options.key",
        "checkpoint.storage_options.secret",
        "checkpoint.storage_options.token",
        "client_kwargs.aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "sas_token",
        "password",
        "connection_string",
        "credentials",
    ):
        assert is_secret_key(key), key
    for key in ("trainer.batch_size", "model.depth", "checkpoint.storage_path", "name", "keys"):
        assert not is_secret_key(key), key


def test_url_passwords_and_signed_query_parameters_are_cut() -> None:
    assert (
        redact_url("see https://ann:hunter22@mlflow.example/api")
        == f"see https://ann:{REDACTED}@mlflow.example/api"
    )
    signed = redact_url("gs://b/x?X-Goog-Signature=abc123&alt=media")
    assert "abc123" not in signed and "alt=media" in signed
    assert redact_url("s3://bucket/run-1/step_10") == "s3://bucket/run-1/step_10"


def _config() -> dict:
    return {
        "checkpoint": {
            "storage_path": "s3://bucket/runs",
            "storage_options": {
                "key": "AKIAEXAMPLE",
                "secret": "s3cr3t-value",
                "endpoint_url": "http://x",
            },
        },
        "ray": {"runtime_env": {"env_vars": {"WANDB_MODE": "offline", "HF": "hf_tokenvalue"}}},
        "logger": {"mlflow_tracking_uri": "https://ann:hunter22@mlflow.example"},
        "dataset": {"path": "/data/env-path"},
        "trainer": {"batch_size": 32},
    }


def test_a_config_keeps_its_shape_and_loses_its_secrets() -> None:
    env = {"dataset.path": "${oc.env:DATA_DIR}"}
    redactor = Redactor(env, _config())
    out = redactor.config(_config())
    options = out["checkpoint"]["storage_options"]
    assert options == {"key": REDACTED, "secret": REDACTED, "endpoint_url": "http://x"}
    assert out["ray"]["runtime_env"]["env_vars"] == {"WANDB_MODE": REDACTED, "HF": REDACTED}
    assert out["logger"]["mlflow_tracking_uri"] == f"https://ann:{REDACTED}@mlflow.example"
    assert out["dataset"]["path"] == "${oc.env:DATA_DIR}"  # says where it comes from
    assert out["trainer"]["batch_size"] == 32
    text = str(out)
    for secret in ("AKIAEXAMPLE", "s3cr3t-value", "hf_tokenvalue", "hunter22", "/data/env-path"):
        assert secret not in text


def test_env_sources_finds_every_value_taken_from_the_environment() -> None:
    cfg = OmegaConf.create(
        {"a": {"token": "${oc.env:TOKEN}", "n": 1}, "b": ["x", "${oc.env:B,default}"]}
    )
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert env_sources(raw) == {"a.token": "${oc.env:TOKEN}", "b.1": "${oc.env:B,default}"}


def test_text_is_scrubbed_of_every_secret_value_seen() -> None:
    redactor = Redactor({}, _config())
    line = "upload failed: bad credentials s3cr3t-value for https://ann:hunter22@mlflow.example"
    cleaned = redactor.text(line)
    assert "s3cr3t-value" not in cleaned and "hunter22" not in cleaned
    assert cleaned.startswith("upload failed: bad credentials <redacted>")


def test_a_secret_override_is_replaced_by_where_the_command_reads_it() -> None:
    redactor = Redactor({}, _config())
    text, note = redactor.override("+checkpoint.storage_options.secret=s3cr3t-value")
    assert (
        text
        == "+checkpoint.storage_options.secret=${oc.env:FTJOB_CHECKPOINT_STORAGE_OPTIONS_SECRET}"
    )
    assert note is not None and "$FTJOB_CHECKPOINT_STORAGE_OPTIONS_SECRET" in note
    # From the environment already: kept as it is (usable, and not a secret).
    assert redactor.override("checkpoint.storage_options.secret=${oc.env:S}") == (
        "checkpoint.storage_options.secret=${oc.env:S}",
        None,
    )
    assert redactor.override("trainer.epochs=3") == ("trainer.epochs=3", None)


def test_hydras_record_of_the_job_loses_the_secrets_of_its_command_line() -> None:
    redactor = Redactor({}, _config())
    secret = "+checkpoint.storage_options.secret=short"  # too short to scrub as text
    record = {
        "hydra": {
            "overrides": {"task": [secret, "trainer.epochs=2"], "hydra": []},
            "job": {"override_dirname": f"{secret},trainer.epochs=2"},
        }
    }
    out = redactor.hydra(record)
    assert "short" not in str(out)
    assert out["hydra"]["overrides"]["task"][1] == "trainer.epochs=2"
    assert out["hydra"]["job"]["override_dirname"].endswith(",trainer.epochs=2")
