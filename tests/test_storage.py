"""The retry policy and the retrying filesystem, without Ray, network or sleeping: sleep, clock
and jitter are injected, failures are scripted."""

from __future__ import annotations

import errno
import gc
import http.client
import logging
import pickle
import random
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import botocore.exceptions as boto
import pyarrow.fs
import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from s3fs.errors import translate_boto_error

from ftjob.config import ConfigError, RetryConfig, StorageChaosConfig
from ftjob.retry import ErrorClassifier, OpStats, RetryPolicy, StorageStats
from ftjob.storage import (
    INJECTED_ERRORS,
    FaultInjectingFileSystem,
    RetryingFileSystem,
    StorageError,
    _DelegatingFileSystem,
    build_filesystem,
    innermost,
    preflight,
    split_options,
    to_pyarrow,
)

S3_TARGET = "s3://ckpt-bucket/runs/exp1/checkpoints/step_000000010/model.pt"


class FakeTime:
    """Clock and sleep for the policy: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def policy(fake: FakeTime, seed: int = 0, **overrides: Any) -> RetryPolicy:
    config = {"initial_backoff": 0.5, "multiplier": 2.0, "max_backoff": 20.0, "jitter": 0.0}
    config.update(overrides)
    return RetryPolicy(
        RetryConfig(**config), sleep=fake.sleep, clock=fake.clock, rng=random.Random(seed)
    )


def failing(errors: list[BaseException], result: Any = "ok") -> Callable[[], Any]:
    """A call that raises ``errors`` in turn, then returns ``result``."""
    queue = list(errors)

    def fn() -> Any:
        if queue:
            raise queue.pop(0)
        return result

    return fn


def client_error(code: str, message: str, status: int) -> boto.ClientError:
    response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {}}
    response["ResponseMetadata"]["HTTPStatusCode"] = status
    return boto.ClientError(response, "PutObject")


# -- classification ---------------------------------------------------------------------------

TRANSIENT = {
    # What s3fs raises for S3's answers (translate_boto_error is the function s3fs uses).
    "SlowDown 503": translate_boto_error(
        client_error("SlowDown", "Please reduce your request rate.", 503)
    ),
    "503 without a body": translate_boto_error(client_error("503", "Service Unavailable", 503)),
    "ServiceUnavailable": translate_boto_error(
        client_error("ServiceUnavailable", "Reduce your request rate.", 503)
    ),
    "InternalError 500": translate_boto_error(
        client_error("InternalError", "We encountered an internal error.", 500)
    ),
    "500 without a body": translate_boto_error(client_error("500", "Internal Server Error", 500)),
    "RequestTimeout": translate_boto_error(
        client_error("RequestTimeout", "Your socket connection to the server was not read", 400)
    ),
    "429 Throttling": translate_boto_error(client_error("Throttling", "Rate exceeded", 429)),
    "connection reset": ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    "connection refused": ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
    "connection aborted": ConnectionAbortedError(errno.ECONNABORTED, "Software caused abort"),
    "read timed out": TimeoutError("The read operation timed out"),
    "botocore closed": boto.ConnectionClosedError(endpoint_url="http://s3"),
    "botocore unreachable": boto.EndpointConnectionError(endpoint_url="http://s3"),
    "botocore connect timeout": boto.ConnectTimeoutError(endpoint_url="http://s3"),
    "botocore read timeout": boto.ReadTimeoutError(endpoint_url="http://s3"),
    "botocore truncated": boto.IncompleteReadError(actual_bytes=10, expected_bytes=20),
    "aiohttp disconnected": aiohttp.ServerDisconnectedError(),
    "aiohttp truncated": aiohttp.ClientPayloadError("Response payload is not completed"),
    "http.client truncated": http.client.IncompleteRead(b"partial", 100),
}

PERMANENT = {
    "AccessDenied": translate_boto_error(client_error("AccessDenied", "Access Denied", 403)),
    "403 without a body": translate_boto_error(client_error("403", "Forbidden", 403)),
    "NoSuchBucket": translate_boto_error(
        client_error("NoSuchBucket", "The specified bucket does not exist", 404)
    ),
    "InvalidAccessKeyId": translate_boto_error(
        client_error("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist", 403)
    ),
    "SignatureDoesNotMatch": translate_boto_error(
        client_error("SignatureDoesNotMatch", "The request signature we calculated", 403)
    ),
    "ExpiredToken": translate_boto_error(client_error("ExpiredToken", "token expired", 400)),
    "no credentials": boto.NoCredentialsError(),
    "missing file": FileNotFoundError(errno.ENOENT, "No such file or directory"),
    "path is a directory": IsADirectoryError(errno.EISDIR, "Is a directory"),
    "bad path": NotADirectoryError(errno.ENOTDIR, "Not a directory"),
    "unknown error": ValueError("something nobody anticipated"),
}


@pytest.mark.parametrize("exc", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_default_transient_errors(exc: BaseException) -> None:
    assert ErrorClassifier().is_transient(exc)


@pytest.mark.parametrize("exc", PERMANENT.values(), ids=PERMANENT.keys())
def test_default_permanent_errors(exc: BaseException) -> None:
    assert not ErrorClassifier().is_transient(exc)


def test_s3fs_translations_carry_the_errnos_the_classifier_expects() -> None:
    # If s3fs changed its mapping, the errno rules would silently stop matching.
    assert TRANSIENT["SlowDown 503"].errno == errno.EBUSY
    assert TRANSIENT["InternalError 500"].errno == errno.EREMOTEIO
    assert isinstance(PERMANENT["AccessDenied"], PermissionError)
    assert isinstance(PERMANENT["NoSuchBucket"], FileNotFoundError)


def test_a_path_in_the_message_does_not_decide_the_class() -> None:
    throttled = OSError(errno.EBUSY, "SlowDown (put_file s3://b/exp-403/forbidden/model.pt)")
    assert ErrorClassifier().is_transient(throttled)
    missing = FileNotFoundError("s3://b/exp-503/timed-out/model.pt")
    assert not ErrorClassifier().is_transient(missing)


def test_a_transient_cause_makes_a_wrapping_error_transient() -> None:
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert ErrorClassifier().is_transient(outer)


def test_user_rules_come_before_the_defaults() -> None:
    quota = RuntimeError("Quota exceeded for bucket")
    assert not ErrorClassifier().is_transient(quota)
    assert ErrorClassifier(retry_on=("quota exceeded",)).is_transient(quota)  # message regex
    assert ErrorClassifier(retry_on=("RuntimeError",)).is_transient(quota)  # type name
    slow = TRANSIENT["SlowDown 503"]
    assert not ErrorClassifier(give_up_on=("reduce your request rate",)).is_transient(slow)
    # give_up_on wins over retry_on
    assert not ErrorClassifier(retry_on=("Quota",), give_up_on=("Quota",)).is_transient(quota)


@pytest.mark.parametrize("key", ["retry_on", "give_up_on"])
def test_an_invalid_rule_is_refused_at_startup_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"checkpoint\.retry\.{key}.*\(unclosed"):
        RetryPolicy(RetryConfig(**{key: ["(unclosed"]}))


# -- backoff and stopping -----------------------------------------------------------------


def test_backoff_grows_by_the_multiplier_up_to_the_cap() -> None:
    fake = FakeTime()
    p = policy(fake, max_attempts=6, initial_backoff=1.0, multiplier=2.0, max_backoff=5.0)
    transient = [TimeoutError("timed out")] * 5
    assert p.call(failing(transient), op="put_file", target="memory://x") == "ok"
    assert fake.sleeps == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_jitter_stays_within_its_bounds_and_the_cap() -> None:
    fake = FakeTime()
    p = policy(fake, seed=7, max_attempts=9, initial_backoff=1.0, max_backoff=10.0, jitter=0.25)
    stats = OpStats()
    p.call(failing([TimeoutError()] * 8), op="cat_file", target="memory://x", stats=stats)
    bases = [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]
    assert len(fake.sleeps) == len(bases)
    for wait, base in zip(fake.sleeps, bases, strict=True):
        assert base * 0.75 <= wait <= min(10.0, base * 1.25)
    assert len(set(fake.sleeps[:4])) == 4 and fake.sleeps[:4] != bases[:4]  # jitter applied
    assert stats.retry_wait_s == pytest.approx(sum(fake.sleeps))
    # The same seed draws the same waits.
    again = FakeTime()
    policy(again, seed=7, max_attempts=9, initial_backoff=1.0, max_backoff=10.0, jitter=0.25).call(
        failing([TimeoutError()] * 8), op="cat_file", target="memory://x"
    )
    assert again.sleeps == fake.sleeps


def test_gives_up_after_max_attempts_with_the_last_error() -> None:
    fake = FakeTime()
    stats = OpStats()
    errors = [OSError(errno.EBUSY, f"Please reduce your request rate ({i})") for i in range(5)]
    with pytest.raises(OSError) as info:
        policy(fake, max_attempts=4).call(
            failing(errors), op="pipe_file", target=S3_TARGET, stats=stats
        )
    assert info.value.errno == errno.EBUSY  # same type and errno as the storage's error
    assert "(3)" in str(info.value) and "gave up after 4 attempts" in str(info.value)
    assert S3_TARGET in str(info.value) and "'ckpt-bucket'" in str(info.value)
    assert (stats.calls, stats.attempts, stats.retries, stats.failures) == (1, 4, 3, 1)
    assert len(fake.sleeps) == 3


def test_deadline_stops_before_a_wait_that_would_end_past_it() -> None:
    fake = FakeTime()
    stats = OpStats()
    p = policy(
        fake, max_attempts=100, initial_backoff=4.0, multiplier=1.0, max_backoff=4.0, deadline=10.0
    )
    with pytest.raises(TimeoutError):
        p.call(failing([TimeoutError()] * 100), op="ls", target="memory://x", stats=stats)
    assert fake.sleeps == [4.0, 4.0]  # a third wait would end at 12 s > 10 s
    assert stats.attempts == 3


def test_deadline_counts_time_spent_in_slow_attempts() -> None:
    fake = FakeTime()

    def slow_timeout() -> None:
        fake.now += 6.0
        raise TimeoutError("Read timed out")

    p = policy(
        fake, max_attempts=100, initial_backoff=1.0, multiplier=1.0, max_backoff=1.0, deadline=10.0
    )
    stats = OpStats()
    with pytest.raises(TimeoutError):
        p.call(slow_timeout, op="get_file", target="memory://x", stats=stats)
    assert stats.attempts == 2  # 6 s + 1 s wait + 6 s: the next wait would end at 14 s


def test_permanent_error_fails_at_once_naming_path_and_bucket() -> None:
    fake = FakeTime()
    stats = OpStats()
    denied = translate_boto_error(client_error("AccessDenied", "Access Denied", 403))
    with pytest.raises(PermissionError) as info:
        policy(fake).call(failing([denied]), op="put_file", target=S3_TARGET, stats=stats)
    message = str(info.value)
    assert "Access Denied" in message and S3_TARGET in message and "bucket 'ckpt-bucket'" in message
    assert "not retried" in message
    assert fake.sleeps == [] and stats.attempts == 1 and stats.failures == 1
    assert info.value.__cause__ is denied  # the original stays reachable


def test_every_retry_is_logged_once_with_op_path_attempt_error_and_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeTime()
    errors = [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")] * 2
    with caplog.at_level(logging.WARNING, logger="ftjob.storage"):
        policy(fake, max_attempts=5).call(failing(errors), op="put_file", target=S3_TARGET)
    retries = [r.getMessage() for r in caplog.records if "storage retry" in r.getMessage()]
    assert len(retries) == 2
    assert "put_file" in retries[0] and S3_TARGET in retries[0]
    assert "attempt 1/5" in retries[0] and "attempt 2/5" in retries[1]
    assert "Connection reset by peer" in retries[0] and "next try in 0.50s" in retries[0]
    assert "next try in 1.00s" in retries[1]


# -- the filesystem layer -----------------------------------------------------------------


class ScriptedFileSystem(_DelegatingFileSystem):
    """Raises the scripted errors of an operation before forwarding it; records every call."""

    def __init__(self, fs: AbstractFileSystem, script: dict[str, list[BaseException]]) -> None:
        super().__init__(fs)
        self.script = {op: list(errors) for op, errors in script.items()}
        self.calls: list[tuple[str, str]] = []

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        self.calls.append((op, path))
        errors = self.script.get(op)
        if errors:
            raise errors.pop(0)
        return fn()


@pytest.fixture
def memfs() -> Iterator[MemoryFileSystem]:
    """An empty in-memory filesystem (its store is process-global: emptied, then restored)."""
    saved_store, saved_dirs = dict(MemoryFileSystem.store), list(MemoryFileSystem.pseudo_dirs)
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    try:
        yield MemoryFileSystem()
    finally:
        MemoryFileSystem.store.clear()
        MemoryFileSystem.store.update(saved_store)
        MemoryFileSystem.pseudo_dirs[:] = saved_dirs


def retrying(inner: AbstractFileSystem, fake: FakeTime, **overrides: Any) -> RetryingFileSystem:
    return RetryingFileSystem(inner, policy(fake, **overrides))


def test_stats_count_attempts_retries_failures_and_success_rate(memfs: MemoryFileSystem) -> None:
    slow = OSError(errno.EBUSY, "SlowDown")
    scripted = ScriptedFileSystem(
        memfs,
        {
            "pipe_file": [slow, slow],  # succeeds on the third attempt
            "put_file": [slow, slow, slow],  # gives up
            "cat_file": [PermissionError("AccessDenied")],  # permanent
        },
    )
    fake = FakeTime()
    fs = retrying(scripted, fake, max_attempts=3)
    fs.pipe_file("/stats/a", b"data")
    with pytest.raises(OSError):
        fs.put_file(__file__, "/stats/b")
    with pytest.raises(PermissionError):
        fs.cat_file("/stats/a")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("/stats/missing")  # an answer, not a failure
    stats = fs.snapshot_stats().as_dict()
    assert stats["upload"] == {
        "calls": 2,
        "attempts": 6,
        "retries": 4,
        "failures": 1,
        "not_found": 0,
        "retry_wait_s": 3.0,  # 0.5 + 1.0 per call
        "success_rate": 0.5,
    }
    assert stats["download"]["calls"] == 2 and stats["download"]["failures"] == 1
    assert stats["download"]["not_found"] == 1 and stats["download"]["success_rate"] == 0.5
    # Round trip through the ledger's JSON form, and snapshots are copies.
    assert StorageStats.from_dict(stats).as_dict() == stats
    snapshot = fs.snapshot_stats()
    fs.pipe_file("/stats/c", b"more")
    assert snapshot.kind("upload").calls == 2


def test_every_forwarded_operation_reaches_the_inner_filesystem(
    memfs: MemoryFileSystem, tmp_path: Any
) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(scripted, FakeTime())
    local = tmp_path / "local.bin"
    local.write_bytes(b"local")
    fs.makedirs("/ops/dir", exist_ok=True)
    fs.mkdir("/ops/dir2")
    fs.pipe_file("/ops/dir/a", b"A")
    fs.put_file(str(local), "/ops/dir/b")
    assert fs.cat_file("/ops/dir/a") == b"A"
    fs.get_file("/ops/dir/b", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"local"
    assert sorted(fs.ls("/ops/dir", detail=False)) == ["/ops/dir/a", "/ops/dir/b"]
    assert fs.info("/ops/dir/a")["size"] == 1
    assert sorted(fs.find("/ops")) == ["/ops/dir/a", "/ops/dir/b"]
    fs.cp_file("/ops/dir/a", "/ops/dir/c")
    fs.copy("/ops/dir/c", "/ops/dir/d")
    fs.mv("/ops/dir/d", "/ops/dir/e")
    fs.rm_file("/ops/dir/c")
    fs.rm("/ops/dir/e")
    fs.rmdir("/ops/dir2")
    assert fs.exists("/ops/dir/a") and not fs.exists("/ops/dir/c")
    seen = {op for op, _ in scripted.calls}
    assert seen >= {"pipe_file", "put_file", "cat_file", "get_file", "ls", "find", "info", "mkdir"}
    assert seen >= {"makedirs", "cp_file", "copy", "mv", "rm_file", "rm", "rmdir"}
    assert ("put_file", "/ops/dir/b") in scripted.calls  # the storage path, not the local one


def test_write_handles_upload_on_close_with_retries(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(memfs, {"pipe_file": [ConnectionResetError("reset")] * 2})
    fs = retrying(scripted, FakeTime())
    with fs.open("/handles/snapshot.json", "wb") as f:
        f.write(b'{"step": ')
        f.write(b"10}")
    assert memfs.cat_file("/handles/snapshot.json") == b'{"step": 10}'
    assert fs.snapshot_stats().kind("upload").attempts == 3
    with fs.open("/handles/snapshot.json", "rb") as f:
        assert f.read() == b'{"step": 10}'


def test_a_write_handle_left_by_an_exception_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    with pytest.raises(RuntimeError):
        with fs.open("/handles/half.bin", "wb") as f:
            f.write(b"first half")
            raise RuntimeError("writer died")
    assert not memfs.exists("/handles/half.bin")


def test_a_write_handle_dropped_without_close_publishes_nothing(memfs: MemoryFileSystem) -> None:
    fs = retrying(memfs, FakeTime())
    f = fs.open("/handles/dropped.bin", "wb")
    f.write(b"half of a snapshot")
    del f
    gc.collect()
    assert not memfs.exists("/handles/dropped.bin")
    f = fs.open("/handles/closed.bin", "wb")
    f.write(b"whole")
    f.close()  # an explicit close after a complete write is what publishes
    assert memfs.cat_file("/handles/closed.bin") == b"whole"


def test_pyarrow_wrapper_round_trip_goes_through_the_policy(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(
        memfs, {"pipe_file": [OSError(errno.EBUSY, "SlowDown")], "cat_file": [TimeoutError()]}
    )
    fs = retrying(scripted, FakeTime())
    pa = to_pyarrow(fs)
    pa.create_dir("/pa/run")
    with pa.open_output_stream("/pa/run/state.json") as out:
        out.write(b"payload")
    with pa.open_input_stream("/pa/run/state.json") as stream:
        assert stream.read() == b"payload"
    info = pa.get_file_info("/pa/run/state.json")
    assert info.type == pyarrow.fs.FileType.File and info.size == 7
    listing = pa.get_file_info(pyarrow.fs.FileSelector("/pa/run", recursive=True))
    assert [i.path for i in listing] == ["/pa/run/state.json"]
    pa.copy_file("/pa/run/state.json", "/pa/run/copy.json")
    pa.move("/pa/run/copy.json", "/pa/run/moved.json")
    pa.delete_dir("/pa/run")
    assert not memfs.exists("/pa/run/state.json")
    stats = fs.snapshot_stats()
    assert stats.kind("upload").retries == 1 and stats.kind("download").retries == 1


def test_pickling_keeps_the_policy_and_the_layers(memfs: MemoryFileSystem) -> None:
    config = RetryConfig(max_attempts=7, initial_backoff=0.1, retry_on=["QuotaExceeded"])
    fs = RetryingFileSystem(
        FaultInjectingFileSystem(memfs, 0.2, ["throttle", "reset"], seed=5), RetryPolicy(config)
    )
    fs.pipe_file("/pickle/x", b"x")
    # Ray Train pickles the pyarrow wrapper to its controller and workers.
    copy = pickle.loads(pickle.dumps(to_pyarrow(fs))).handler.fs
    assert isinstance(copy, RetryingFileSystem)
    assert copy.policy.config == config
    assert copy.policy.classifier.is_transient(RuntimeError("QuotaExceeded"))
    assert isinstance(copy.fs, FaultInjectingFileSystem)
    assert (copy.fs.failure_rate, copy.fs.errors, copy.fs.seed) == (0.2, ["throttle", "reset"], 5)
    assert copy.snapshot_stats().as_dict() == {}  # counts belong to the process that made them


class _RetryingInnerFileSystem(MemoryFileSystem):
    """Stands in for s3fs: request retries are a class attribute, not a constructor option."""

    cachable = False
    retries = 5


def test_inner_retries_survive_pickling(memfs: MemoryFileSystem) -> None:
    fs = RetryingFileSystem(_RetryingInnerFileSystem(), RetryPolicy(), inner_retries=1)
    assert innermost(fs).retries == 1
    copy = pickle.loads(pickle.dumps(fs))
    assert innermost(copy) is not innermost(fs)
    assert innermost(copy).retries == 1


def test_s3_options_switch_off_the_retries_below_ours() -> None:
    options, inner = split_options("s3", {"endpoint_url": "http://127.0.0.1:9"})
    assert inner == 1  # s3fs: one try per request
    # botocore: total_max_attempts counts tries; its max_attempts would count retries.
    assert options["config_kwargs"]["retries"]["total_max_attempts"] == 1
    assert options["endpoint_url"] == "http://127.0.0.1:9"
    assert "retries" not in options  # not an s3fs constructor argument
    # Users can turn them back on.
    own = {"retries": 4, "config_kwargs": {"retries": {"mode": "adaptive"}, "read_timeout": 5}}
    options, inner = split_options("s3", own)
    assert inner == 4
    assert options["config_kwargs"] == {"retries": {"mode": "adaptive"}, "read_timeout": 5}
    assert split_options("file", {}) == ({}, None)


def test_build_filesystem_hands_options_to_s3fs() -> None:
    fs, path = build_filesystem(
        "s3://some-bucket/prefix",
        {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
        RetryConfig(max_attempts=3),
    )
    s3 = innermost(fs)
    assert path == "some-bucket/prefix"
    assert (s3.endpoint_url, s3.key, s3.retries) == ("http://127.0.0.1:9", "k", 1)
    assert s3.config_kwargs["retries"]["total_max_attempts"] == 1
    assert fs.policy.config.max_attempts == 3
    assert fs.unstrip_protocol(path) == "s3://some-bucket/prefix"


def test_build_filesystem_adds_fault_injection_only_when_asked(tmp_path: Any) -> None:
    plain, _ = build_filesystem(str(tmp_path), {}, RetryConfig())
    assert not isinstance(plain.fs, FaultInjectingFileSystem)
    chaos = StorageChaosConfig(failure_rate=0.3, errors=["reset"])
    faulty, path = build_filesystem(str(tmp_path), {}, RetryConfig(), chaos, seed=3)
    assert isinstance(faulty.fs, FaultInjectingFileSystem)
    assert (faulty.fs.failure_rate, faulty.fs.errors, faulty.fs.seed) == (0.3, ["reset"], 3)


def test_a_slow_store_delays_checkpoint_uploads_only(memfs: MemoryFileSystem) -> None:
    slept: list[float] = []
    slow = FaultInjectingFileSystem(memfs, 0.0, ["reset"], upload_delay=2.5, sleep=slept.append)
    slow.pipe_file("/run/checkpoints/step_000000010/model.pt", b"weights")
    slow.pipe_file("/run/checkpoint_manager_snapshot.json", b"{}")  # Ray Train's bookkeeping
    slow.cat_file("/run/checkpoints/step_000000010/model.pt")
    assert slept == [2.5]
    chaos = StorageChaosConfig(upload_delay=1.0)
    fs, _ = build_filesystem("memory://slow", {}, RetryConfig(), chaos)
    assert isinstance(fs.fs, FaultInjectingFileSystem) and fs.fs.upload_delay == 1.0


# -- fault injection ------------------------------------------------------------------------


def _pattern(seed: int, n: int = 300, rate: float = 0.3) -> list[str | None]:
    scripted = ScriptedFileSystem(MemoryFileSystem(), {})
    faulty = FaultInjectingFileSystem(scripted, rate, ["throttle", "reset", "timeout"], seed=seed)
    out: list[str | None] = []
    for _ in range(n):
        try:
            faulty.info("/")
            out.append(None)
        except Exception as exc:
            out.append(type(exc).__name__)
    return out


def test_fault_injection_is_seeded_and_hits_its_rate() -> None:
    first, again, other = _pattern(1), _pattern(1), _pattern(2)
    assert first == again
    assert first != other
    rate = sum(p is not None for p in _pattern(3, n=2000)) / 2000
    assert 0.26 <= rate <= 0.34
    assert {p for p in first if p} == {"OSError", "ConnectionResetError", "TimeoutError"}


@pytest.mark.parametrize(
    ("kind", "transient"),
    [("throttle", True), ("reset", True), ("timeout", True), ("permanent", False)],
)
def test_injected_error_kinds_classify_as_intended(kind: str, transient: bool) -> None:
    assert ErrorClassifier().is_transient(INJECTED_ERRORS[kind]("put_file /x")) is transient


def test_permanent_faults_hit_checkpoint_uploads_only_and_are_not_retried(
    memfs: MemoryFileSystem,
) -> None:
    scripted = ScriptedFileSystem(memfs, {})
    fs = retrying(FaultInjectingFileSystem(scripted, 0.5, ["permanent"], seed=0), FakeTime())
    outcomes = []
    for i in range(40):
        try:
            fs.pipe_file(f"/run/checkpoints/step_{i:09d}/model.pt", b"x")
            outcomes.append(True)
        except PermissionError:
            outcomes.append(False)
    assert 0 < outcomes.count(False) < 40
    assert len(scripted.calls) == outcomes.count(True)  # failed calls were not retried
    assert fs.snapshot_stats().kind("upload").retries == 0
    # Ray Train's own files, and reads, never get a permanent fault: it would only end the job.
    memfs.pipe_file("/run/checkpoints/step_000000099/model.pt", b"committed")
    for i in range(40):
        fs.pipe_file(f"/run/checkpoint_manager_snapshot_{i}.json", b"{}")
        assert fs.cat_file("/run/checkpoints/step_000000099/model.pt") == b"committed"
        fs.ls("/run")


def test_transient_injection_is_absorbed_by_retries(memfs: MemoryFileSystem) -> None:
    fake = FakeTime()
    fs = retrying(
        FaultInjectingFileSystem(memfs, 0.3, ["throttle", "reset", "timeout"], seed=4),
        fake,
        max_attempts=12,
    )
    for i in range(50):
        fs.pipe_file(f"/absorb/{i}", b"x")
    upload = fs.snapshot_stats().kind("upload")
    assert upload.failures == 0 and upload.retries > 0
    assert len(memfs.find("/absorb")) == 50


# -- preflight --------------------------------------------------------------------------------


def test_preflight_creates_the_local_directory_and_leaves_no_probe(tmp_path: Any) -> None:
    fs, path = build_filesystem(str(tmp_path / "new" / "checkpoints"), {}, RetryConfig())
    preflight(fs, path)
    assert (tmp_path / "new" / "checkpoints").is_dir()
    assert list((tmp_path / "new" / "checkpoints").iterdir()) == []


def test_preflight_reports_a_permission_problem_with_the_key(memfs: MemoryFileSystem) -> None:
    denied = translate_boto_error(client_error("AccessDenied", "Access Denied", 403))
    fs = retrying(ScriptedFileSystem(memfs, {"pipe_file": [denied]}), FakeTime())
    with pytest.raises(
        StorageError, match=r"checkpoint\.storage_path='memory:///pre'.*no permission.*AWS_\*"
    ):
        preflight(fs, "/pre")


def test_preflight_reports_an_unreachable_store_after_the_retries(memfs: MemoryFileSystem) -> None:
    scripted = ScriptedFileSystem(
        memfs, {"pipe_file": [boto.EndpointConnectionError(endpoint_url="http://s3")] * 3}
    )
    fake = FakeTime()
    with pytest.raises(StorageError, match=r"did not answer after all retries.*endpoint_url"):
        preflight(retrying(scripted, fake, max_attempts=3), "/unreachable")
    assert len(fake.sleeps) == 2
