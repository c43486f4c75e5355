"""The retry policy (ftjob.storage.retry): backoff, jitter, attempts and deadline, what it raises
and logs. Sleep, clock and jitter are injected, failures are scripted."""

from __future__ import annotations

import errno
import logging

import pytest
from s3fs.errors import translate_boto_error

from ftjob.storage.retry import OpStats
from tests.support.storage import (
    S3_TARGET,
    FakeTime,
    client_error,
    failing,
    policy,
)


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
    with caplog.at_level(logging.WARNING, logger="ftjob.storage.retry"):
        policy(fake, max_attempts=5).call(failing(errors), op="put_file", target=S3_TARGET)
    retries = [r.getMessage() for r in caplog.records if "storage retry" in r.getMessage()]
    assert len(retries) == 2
    assert "put_file" in retries[0] and S3_TARGET in retries[0]
    assert "attempt 1/5" in retries[0] and "attempt 2/5" in retries[1]
    assert "Connection reset by peer" in retries[0] and "next try in 0.50s" in retries[0]
    assert "next try in 1.00s" in retries[1]
