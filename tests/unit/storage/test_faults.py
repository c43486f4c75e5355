"""Storage faults on purpose (ftjob.storage.faults): seeded at their rate, of the kinds asked for,
permanent ones on checkpoint uploads only, transient ones absorbed by the retries, slow uploads."""

from __future__ import annotations

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ftjob.config import RetryConfig, StorageChaosConfig
from ftjob.storage.errors import ErrorClassifier
from ftjob.storage.faults import INJECTED_ERRORS, FaultInjectingFileSystem
from ftjob.storage.fs import (
    build_filesystem,
)
from tests.support.storage import (
    FakeTime,
    ScriptedFileSystem,
    retrying,
)


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
