"""Secrets stay secret: configs, overrides, the resume command and text are redacted."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import logging
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from ftjob.config.secrets import (
    REDACTED,
    Redactor,
    env_sources,
    guard_logging,
    is_secret_key,
    redact_url,
    redactor_for,
)
from ftjob.driver.ledger import empty_snapshot
from ftjob.record import Failure


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


# -- every spelling, every channel ---------------------------------------------------------
# Each row: an override as a user types it, and the secret values it carries. Every channel
# below is checked against every row.
SESSION = "FwoGZXIvYXdzEBYaDSESSIONTOKEN"
SECRET_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("+checkpoint.storage_options.key=AKIAIOSFODNN7EXAMPLE", ("AKIAIOSFODNN7EXAMPLE",)),
    ("+checkpoint.storage_options.secret=wJalrXUtnFEMIK7MDENG", ("wJalrXUtnFEMIK7MDENG",)),
    (f"+checkpoint.storage_options.SessionToken={SESSION}", (SESSION,)),
    ("+checkpoint.storage_options.accessToken=ya29.accessTOKENvalue", ("ya29.accessTOKENvalue",)),
    ("+checkpoint.storage_options.apiKey=sk-live-51Habcdef", ("sk-live-51Habcdef",)),
    ("+checkpoint.storage_options.AccountKey=azACCOUNTkeyVALUE", ("azACCOUNTkeyVALUE",)),
    ("+checkpoint.storage_options.sasToken=sv2021sigABCDEF", ("sv2021sigABCDEF",)),
    ("+checkpoint.storage_options.privateKey=MIIEvQIBADANBgkq", ("MIIEvQIBADANBgkq",)),
    ("+checkpoint.storage_options.passphrase=correcthorsebattery", ("correcthorsebattery",)),
    ("+checkpoint.storage_options.aws_session_token=IQoJb3JpZ2luX2Vj", ("IQoJb3JpZ2luX2Vj",)),
    ("+checkpoint.storage_options.connection_string=AccountName1x", ("AccountName1x",)),
    ("+checkpoint.storage_options.password=hunter2", ("hunter2",)),  # short: a whole token
    (
        "+checkpoint.storage_options.client_kwargs="
        "{headers: {Authorization: 'Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIG', Cookie: 'sid=c00kieVALUE'}}",
        ("eyJhbGciOiJIUzI1NiJ9.e30.SIG", "sid=c00kieVALUE"),
    ),
    (  # a list under a secret key
        "+checkpoint.storage_options.token=[ya29.LISTtokenONE, ya29.LISTtokenTWO]",
        ("ya29.LISTtokenONE", "ya29.LISTtokenTWO"),
    ),
    (  # a dict under a secret key: its children, whatever their names
        "+checkpoint.storage_options.credentials="
        "{AccessKeyId: AKIAEXAMPLECHILD, SecretAccessKey: childSECRETvalue, expiry: '2030-01-01T00:00Z'}",
        ("AKIAEXAMPLECHILD", "childSECRETvalue", "2030-01-01T00:00Z"),
    ),
    (  # HTTP headers as a list of pairs (aiohttp takes them so): the secret is by its name's side
        "+checkpoint.storage_options.headers="
        "[[Authorization, 'Bearer hdrPAIRtokenVALUE1'], [Accept, text/plain]]",
        ("hdrPAIRtokenVALUE1",),
    ),
    (  # a header as {name, value}
        "+checkpoint.storage_options.extra_headers=[{name: X-Api-Key, value: namedVALUEsecret9}]",
        ("namedVALUEsecret9",),
    ),
    # Plural and short spellings of a credential key.
    (
        "+checkpoint.storage_options.tokens=[ghp_abcdefghijklmnopqrstuvwxyz0123]",
        ("ghp_abcdefghijklmnopqrstuvwxyz0123",),
    ),
    ("+checkpoint.storage_options.pass=s3cr3tPASSvalue", ("s3cr3tPASSvalue",)),
]
SECRET_OVERRIDES = [row[0] for row in SECRET_ROWS]
SECRET_VALUES = [value for row in SECRET_ROWS for value in row[1]]


@pytest.mark.parametrize(
    "key",
    [
        "key", "secret", "token", "password", "credentials", "connection_string",
        "aws_secret_access_key", "AWS_SECRET_ACCESS_KEY", "aws_session_token", "SessionToken",
        "sessionToken", "session-token", "accessToken", "access_token", "apiKey", "api_key",
        "APIKey", "apikey", "X-Api-Key", "AccountKey", "account_key", "accountkey", "sasToken",
        "SAS_TOKEN", "sas", "privateKey", "private_key", "passphrase", "Passphrase", "passwd",
        "Authorization", "authorization", "Proxy-Authorization", "Cookie", "cookie",
        "Set-Cookie", "refresh_token", "client_secret", "clientSecret", "X-Amz-Security-Token",
        "signature", "auth", "tokens", "pass", "db_pass", "pw", "passwords", "api_keys",
        "apiKeys", "secrets", "access_tokens", "signatures", "ssh_keys",
    ],
)  # fmt: skip
def test_every_spelling_of_a_credential_key_is_a_secret(key: str) -> None:
    assert is_secret_key(key)
    assert is_secret_key(f"checkpoint.storage_options.{key}")


@pytest.mark.parametrize(
    "key",
    ["trainer.batch_size", "checkpoint.storage_path", "name", "keys", "num_to_keep", "keep",
     "tokenizer", "monkey", "auth_type", "storage_options", "client_kwargs", "headers",
     "endpoint_url", "mlflow_tracking_uri", "wandb_project", "resume"],
)  # fmt: skip
def test_ordinary_keys_are_not_secrets(key: str) -> None:
    assert not is_secret_key(key)


def test_everything_under_a_secret_key_is_redacted_whole() -> None:
    config = {
        "token": ["ya29.one", {"nested": "ya29.two"}],
        "credentials": {"AccessKeyId": "AKIA1", "extra": {"deep": "d33p-value"}},
        "client_kwargs": {"headers": {"Authorization": "Bearer x", "Accept": "text/plain"}},
    }
    out = Redactor(resolved=config).config(config)
    assert out == {
        "token": [REDACTED, {"nested": REDACTED}],
        "credentials": {"AccessKeyId": REDACTED, "extra": {"deep": REDACTED}},
        "client_kwargs": {"headers": {"Authorization": REDACTED, "Accept": "text/plain"}},
    }


def _leaks(text: str) -> list[str]:
    return [value for value in SECRET_VALUES if value in text]


def _dir_leaks(root: Path) -> dict[str, list[str]]:
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            leaked = _leaks(path.read_bytes().decode(errors="replace"))
            if leaked:
                found[str(path.relative_to(root))] = leaked
    return found


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A run prepared as the driver prepares one (storage, dataset, lease), with every row's
    secret in its config."""
    from ftjob.driver.runner import prepare
    from tests.support.jobs import compose_job

    run_dir = tmp_path_factory.mktemp("prepared")
    job = compose_job("dataset=synthetic", "logger=csv", *SECRET_OVERRIDES)
    prep = prepare(job, str(run_dir))
    yield job, prep, run_dir
    prep.lease.release()


def test_the_config_checkpoints_loggers_and_ray_see_has_no_secret(prepared: Any) -> None:
    """``public_config`` is what each checkpoint's config.json keeps, what the loggers (CSV,
    TensorBoard, MLflow, W&B) get as params and Ray Train's ``train_loop_config`` (its
    dashboard) shows."""
    from ftjob.reporting.loggers import LogFeed, build_loggers

    job, prep, run_dir = prepared
    public = prep.public_config
    assert _leaks(json.dumps(public)) == []
    options = public["checkpoint"]["storage_options"]
    assert options["password"] == REDACTED
    assert options["token"] == [REDACTED, REDACTED]
    assert set(options["credentials"].values()) == {REDACTED}
    assert options["client_kwargs"]["headers"] == {"Authorization": REDACTED, "Cookie": REDACTED}
    assert options["headers"] == [["Authorization", REDACTED], ["Accept", "text/plain"]]
    assert options["extra_headers"] == [{"name": "X-Api-Key", "value": REDACTED}]
    assert options["tokens"] == [REDACTED] and options["pass"] == REDACTED
    feed = LogFeed(build_loggers(job.logger, str(run_dir), prep.name))
    feed.params(public)
    assert _dir_leaks(run_dir) == {}


def test_the_resume_command_has_no_secret_and_still_resumes(prepared: Any, monkeypatch) -> None:
    from ftjob.driver.runner import resume_command
    from tests.support.jobs import compose_job

    job, prep, _ = prepared
    command, notes = resume_command(SECRET_OVERRIDES, prep, prep.redactor)
    assert _leaks(command) == [] and len(notes) == len(SECRET_OVERRIDES)
    assert prep.redactor.text(command) == command  # summary.json scrubs it again: unchanged
    # Exported as the notes say, the printed overrides give the run its secrets back.
    for override in SECRET_OVERRIDES:
        key, _, value = override.partition("=")
        variable = "FTJOB_" + "".join(c if c.isalnum() else "_" for c in key[1:]).upper()
        monkeypatch.setenv(variable, value)
    printed = shlex.split(command)[3:-3]
    assert compose_job(*printed).checkpoint.storage_options == job.checkpoint.storage_options


def test_summary_json_and_the_loggers_final_record_have_no_secret(prepared: Any) -> None:
    """A worker's exception text (a URL with its password, a header) becomes
    ``failures[].error`` in summary.json; the loggers' last record (MLflow uploads it as
    summary.json) is the run's result summary, checked here too."""
    from ftjob.driver.runner import Trained, _finish
    from ftjob.reporting.verdict import FitEnd

    job, prep, run_dir = prepared
    empty = empty_snapshot()
    error = (
        "ClientResponseError: 403, url='https://ci:Sup3rS3cretPw@store.example/x' "
        f"headers={{'Authorization': 'Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIG'}} {SESSION}"
    )
    failure = Failure(noticed=empty.started + 1, errors={0: error})
    snapshot = dataclasses.replace(empty, failures=(failure,))
    lines: list[str] = []
    trained = Trained(snapshot, FitEnd())
    result = _finish(job, str(run_dir), prep, trained, time.time(), [], lines.append, prep.redactor)
    written = (run_dir / "summary.json").read_text()
    assert (result.summary.failures[0].error or "").startswith("ClientResponseError: 403")
    for text in (written, json.dumps(result.summary.document()), "\n".join(lines)):
        assert _leaks(text) == [] and "Sup3rS3cretPw" not in text


def _scan_run(root: Path, proc: subprocess.CompletedProcess[str]) -> None:
    leaked = _dir_leaks(root)
    assert leaked == {}, leaked
    assert _leaks(proc.stdout + proc.stderr) == [], proc.stdout + proc.stderr
    env_secret = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
    for path in root.rglob("*.yaml"):
        assert env_secret not in path.read_text(), path


def _ftjob(
    args: list[str], cwd: Path, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    refused = ["dataset=imagefolder", f"dataset.path={cwd / 'no-data'}"]  # stops before Ray
    env_set = "+hydra.job.env_set.AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
    return subprocess.run(
        [sys.executable, "-m", "ftjob", *flags, *refused, *SECRET_OVERRIDES, env_set, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_runs_hydra_records_and_console_have_no_secret(tmp_path: Path) -> None:
    """.hydra/config.yaml, overrides.yaml, hydra.yaml (with ``hydra.job.env_set``), the
    error line."""
    run_dir = tmp_path / "run"
    proc = _ftjob([f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2 and "no images" in proc.stderr, proc.stderr  # refused in the job
    _scan_run(run_dir, proc)
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert config.checkpoint.storage_options.password == REDACTED
    hydra = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra
    assert hydra.job.env_set.AWS_SECRET_ACCESS_KEY == REDACTED


@pytest.mark.parametrize("launcher", ["basic", "ftjob"])
def test_a_sweeps_records_log_lines_and_report_have_no_secret(
    tmp_path: Path, launcher: str
) -> None:
    """Whichever launcher runs it: multirun.yaml, the launch log lines, each job's records
    and summary.json; and the report reads the redacted overrides (``${oc.env:...}`` left
    unresolved)."""
    sweep_dir = tmp_path / "sweep"
    proc = _ftjob(
        ["trainer.epochs=1,2", f"hydra.sweep.dir={sweep_dir}", f"hydra/launcher={launcher}"],
        tmp_path,
        ("-m",),
    )
    assert proc.returncode == 1, proc.stderr
    assert (sweep_dir / "multirun.yaml").is_file() and (sweep_dir / "1" / ".hydra").is_dir()
    _scan_run(sweep_dir, proc)
    with open(sweep_dir / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["trainer.epochs"], r["status"]) for r in rows] == [("1", "failed"), ("2", "failed")]


@pytest.mark.parametrize(
    "override",
    [
        "checkpoint.storage_options.secret=wJalrXUtnFEMIK7MDENG",  # the `+` forgotten
        f"checkpoint.storage_options.SessionToken={SESSION}",
        "checkpoint.storage_options.password=hunter2",
        "checkpoint.storage_options.client_kwargs="
        "{headers: {Authorization: 'Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIG'}}",
    ],
)
def test_a_config_error_names_the_key_without_its_secret(
    override: str, capsys, restore_logging: None
) -> None:
    from ftjob.cli.main import main

    assert main([override]) == 2
    err = capsys.readouterr().err
    assert "config error: checkpoint.storage_options." in err
    assert _leaks(err) == [], err


@contextlib.contextmanager
def written_by(name: str) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """The logger ``name`` and what its records write, as a handler sees them."""
    stream, log = io.StringIO(), logging.getLogger(name)
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        yield log, stream
    finally:
        log.removeHandler(handler)


@pytest.fixture
def restore_logging() -> Any:
    factory = logging.getLogRecordFactory()
    yield
    logging.setLogRecordFactory(factory)


def test_log_records_lose_known_secrets_and_url_passwords(restore_logging: None) -> None:
    """Raw exception text logged anywhere in the process (ftjob's retries, a launcher's
    override lines), its traceback included."""
    redactor = Redactor(resolved={"checkpoint": {"storage_options": {"password": "hunter2"}}})
    guard_logging(redactor)
    with written_by("ftjob.storage.fs.test") as (log, stream):
        try:
            raise OSError("login as ci:hunter2 to https://ci:Sup3rS3cretPw@store.example/x")
        except OSError:
            log.exception("upload failed: %s", "password hunter2 rejected")
        log.warning("#0 : +checkpoint.storage_options.SessionToken=%s", SESSION)
    out = stream.getvalue()
    assert "Traceback" in out and "upload failed: password <redacted> rejected" in out
    for secret in ("hunter2", "Sup3rS3cretPw", SESSION):
        assert secret not in out, out


def test_each_jobs_secrets_stay_scrubbed_after_the_next_job_guards_the_process(
    restore_logging: None,
) -> None:
    # A sweep's jobs run one after another in one process; Hydra logs the next job's
    # launch line before that job guards the process with its own secrets.
    for value in ("first-job-secret-1", "second-job-secret-2"):
        guard_logging(Redactor(resolved={"checkpoint": {"storage_options": {"secret": value}}}))
    with written_by("ftjob.test.sweep") as (log, stream):
        log.warning("jobs: %s and %s", "first-job-secret-1", "second-job-secret-2")
    assert stream.getvalue() == "jobs: <redacted> and <redacted>\n"


def test_a_workers_log_records_lose_the_jobs_secrets(restore_logging: None) -> None:
    """A Ray worker's records reach Ray's log files and the driver's console (streamed, past
    the driver's own guard): the worker guards its own process with the job it was given."""
    from ftjob.worker.loop import guard_worker_logging
    from tests.support.jobs import compose_job

    job = compose_job(
        "+checkpoint.storage_options.secret=wJalrXUtnFEMIK7MDENG",
        "+ray.runtime_env.env_vars.HF_TOKEN=hf_0123456789abcdef",
        "+checkpoint.storage_options.headers=[[Authorization, 'Bearer hdrPAIRtokenVALUE1']]",
    )
    guard_worker_logging(job)
    with written_by("ftjob.storage.retry") as (log, stream):
        log.warning(
            "storage retry: put_file https://ci:Sup3rS3cretPw@store.example/x failed (%s, %s, %s)",
            "SignatureDoesNotMatch for wJalrXUtnFEMIK7MDENG",
            "token hf_0123456789abcdef",
            "sent Bearer hdrPAIRtokenVALUE1",
        )
    out = stream.getvalue()
    assert "storage retry: put_file" in out and "store.example/x" in out
    for secret in ("Sup3rS3cretPw", "wJalrXUtnFEMIK7MDENG", "hf_0123456789abcdef", "hdrPAIR"):
        assert secret not in out, out


@pytest.mark.parametrize(
    "value, text, scrubbed",
    [
        ("wJalrXUtnFEMIK7", "key wJalrXUtnFEMIK7 and xwJalrXUtnFEMIK7x", "key <redacted> and x<redacted>x"),
        ("hunter2", "password hunter2 rejected", "password <redacted> rejected"),
        ("hunter2", "hunter22 is another word", "hunter22 is another word"),
        ("abc", "got 'abc' back", "got '<redacted>' back"),
        ("abc", "abcdef", "abcdef"),
        ("a", "a file failed", "a file failed"),  # too short for free text...
        ("ab", "upload ab", "upload ab"),
    ],
)  # fmt: skip
def test_known_values_are_scrubbed_from_text_by_length(
    value: str, text: str, scrubbed: str
) -> None:
    redactor = Redactor(resolved={"password": value})
    assert redactor.text(text) == scrubbed


@pytest.mark.parametrize("value", ["a", "ab"])
def test_a_very_short_secret_still_goes_by_key(value: str) -> None:
    redactor = Redactor(resolved={"password": value})
    assert redactor.config({"password": value}) == {"password": REDACTED}
    assert redactor.text(f"password='{value}' rejected") == f"password='{REDACTED}' rejected"
    assert redactor.text(f"https://u:{value}@h/x") == f"https://u:{REDACTED}@h/x"
    assert redactor.override(f"+password={value}")[0] == "+password=${oc.env:FTJOB_PASSWORD}"


def test_hydra_env_set_values_are_redacted_and_scrubbed() -> None:
    redactor = Redactor()
    record = {"job": {"env_set": {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRf"}}}
    assert redactor.hydra(record) == {"job": {"env_set": {"AWS_SECRET_ACCESS_KEY": REDACTED}}}
    cfg = OmegaConf.create({"trainer": {"epochs": 1}})
    env_set = {"DB_PASSWORD": "hunter2", "NCCL_DEBUG": "INFO", "HF_HOME": "/cache/hf-home"}
    scrubbed = redactor_for(cfg, env_set).text("hunter2 INFO /cache/hf-home/x")
    assert scrubbed == f"{REDACTED} INFO {REDACTED}/x"


def test_short_environment_values_not_named_as_secrets_stay_in_text() -> None:
    config = {"ray": {"runtime_env": {"env_vars": {"WANDB_MODE": "offline", "DB_PWD": "s3cr"}}}}
    redactor = Redactor(resolved=config)
    assert redactor.config(config)["ray"]["runtime_env"]["env_vars"] == {
        "WANDB_MODE": REDACTED,
        "DB_PWD": REDACTED,
    }
    assert redactor.text("wandb offline; s3cr") == f"wandb offline; {REDACTED}"


def test_the_sweep_report_reads_redacted_overrides_unresolved(tmp_path: Path) -> None:
    from ftjob.reporting.sweep import read_job

    job_dir = tmp_path / "0" / ".hydra"
    job_dir.mkdir(parents=True)
    redacted = ["+checkpoint.storage_options.secret=${oc.env:FTJOB_UNSET_FOR_THIS_TEST}", "a=1"]
    OmegaConf.save(OmegaConf.create(redacted), job_dir / "overrides.yaml")
    row = read_job(str(tmp_path), "0")
    assert row.overrides["a"] == "1"
    assert row.overrides["checkpoint.storage_options.secret"].startswith("${oc.env:")


def test_a_secret_named_beside_its_value_is_redacted_and_scrubbed_wherever_it_appears() -> None:
    """A header given as a pair names the credential beside its value, not above it: the value
    is redacted where it stands and, being known, scrubbed from any other string -- another
    key of the config, an error line, a log record."""
    config = {
        "headers": [
            ["Authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIGSIGSIG"],
            ["Accept", "*/*"],
        ],
        "note": "sent Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIGSIGSIG upstream",
        "tags": ["Accept", "gzip"],  # a pair, but its name is no credential's
    }
    redactor = Redactor(resolved=config)
    assert redactor.config(config) == {
        "headers": [["Authorization", REDACTED], ["Accept", "*/*"]],
        "note": f"sent {REDACTED} upstream",
        "tags": ["Accept", "gzip"],
    }
    line = "request failed: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIGSIGSIG"
    assert redactor.text(line) == f"request failed: Authorization: {REDACTED}"
    # The printed command reads such a value from the environment, not as "<redacted>".
    override = "+checkpoint.storage_options.headers=[[Authorization, 'Bearer eyJhbGciOiJIUzI1NiJ9.e30.SIGSIGSIG']]"
    printed, note = Redactor.for_overrides([override]).override(override)
    assert "eyJhbGci" not in printed and REDACTED not in printed
    assert "FTJOB_CHECKPOINT_STORAGE_OPTIONS_HEADERS" in printed and note is not None
