"""The retrying filesystem (ftjob.storage.fs): its counts, retries of the one request that failed,
creates whose answer was lost, the pyarrow wrapper and pickling, the retries below ours switched
off, build_filesystem and the preflight. Without network or sleeping."""

from __future__ import annotations

import errno
import pickle
from collections.abc import Callable
from typing import Any

import botocore.exceptions as boto
import pyarrow.fs
import pytest
from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from s3fs.errors import translate_boto_error

from ftjob.config import RetryConfig, StorageChaosConfig
from ftjob.storage.faults import FaultInjectingFileSystem
from ftjob.storage.fs import (
    RetryingFileSystem,
    StorageError,
    build_filesystem,
    preflight,
    split_options,
    to_pyarrow,
)
from ftjob.storage.retry import RetryPolicy, StorageStats
from ftjob.storage.wrapper import DelegatingFileSystem, innermost
from tests.support.storage import (
    FakeGCSFileSystem,
    FakeTime,
    ScriptedFileSystem,
    client_error,
    retrying,
)


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


class FlakyMemoryFileSystem(MemoryFileSystem):
    """Its third cp_file fails once with a reset connection; counts every cp_file."""

    cachable = False

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.copies += 1
        if self.copies == 3:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        super().cp_file(path1, path2, **kwargs)


def test_a_bulk_copy_retries_the_one_request_that_failed(memfs: MemoryFileSystem) -> None:
    for i in range(6):
        memfs.pipe_file(f"/bulk/src/f{i}", b"x")
    flaky = FlakyMemoryFileSystem()
    fs = retrying(flaky, FakeTime())
    fs.copy("/bulk/src", "/bulk/dst", recursive=True)
    assert sorted(memfs.find("/bulk/dst")) == [f"/bulk/dst/f{i}" for i in range(6)]
    # Seven requests (the directory and its six files), one of them twice: not all again.
    assert flaky.copies == 8
    assert fs.snapshot_stats().kind("other").retries == 1


def test_an_existing_file_is_not_retried_and_keeps_its_type(memfs: MemoryFileSystem) -> None:
    exists = FileExistsError(errno.EEXIST, "File exists")
    scripted = ScriptedFileSystem(memfs, {"pipe_file": [exists]})
    fake = FakeTime()
    with pytest.raises(FileExistsError) as info:
        retrying(scripted, fake).pipe_file("/x/lease/1.json", b"{}", mode="create")
    assert info.value.errno == errno.EEXIST and "/x/lease/1.json" in str(info.value)
    assert fake.sleeps == [] and len(scripted.calls) == 1


class LostAnswerFileSystem(DelegatingFileSystem):
    """Its first pipe_file reaches the store, then the connection drops before the answer."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        super().__init__(fs)
        self.lost = False

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        result = fn()
        if op == "pipe_file" and not self.lost:
            self.lost = True
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return result


def test_a_create_whose_answer_was_lost_is_ours(memfs: MemoryFileSystem) -> None:
    fs = retrying(LostAnswerFileSystem(memfs), FakeTime())
    fs.pipe_file("/lost/1.json", b'{"token": "ours"}', mode="create")  # the retry finds it
    assert memfs.cat_file("/lost/1.json") == b'{"token": "ours"}'
    # Another writer's file is not ours, retry or not.
    memfs.pipe_file("/lost/2.json", b'{"token": "theirs"}')
    with pytest.raises(FileExistsError):
        fs.pipe_file("/lost/2.json", b'{"token": "ours"}', mode="create")


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


def test_gcs_request_retries_are_switched_off_below_ours() -> None:
    assert split_options("gs", {}) == ({}, 1)
    assert split_options("gcs", {"retries": 3, "project": "p"}) == ({"project": "p"}, 3)
    fs = RetryingFileSystem(FakeGCSFileSystem(), RetryPolicy(), inner_retries=1)
    for copy in (fs, pickle.loads(pickle.dumps(fs))):  # and on the Ray workers
        FakeGCSFileSystem.sent = 0
        with pytest.raises(ConnectionResetError):
            innermost(copy)._request()
        assert FakeGCSFileSystem.sent == 1
    FakeGCSFileSystem.sent = 0
    with pytest.raises(ConnectionResetError):
        FakeGCSFileSystem()._request()  # what gcsfs does left alone
    assert FakeGCSFileSystem.sent == 6


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
