"""Storage for tests, without network or sleeping: filesystems that record or script failures,
retry policies with an injected clock and sleep, S3's errors as s3fs raises them, and a stand-in
for gcsfs's request retries."""

from __future__ import annotations

import errno
import random
from collections.abc import Callable
from typing import Any

import botocore.exceptions as boto
from fsspec import AbstractFileSystem

from ftjob.config import RetryConfig
from ftjob.storage.fs import RetryingFileSystem
from ftjob.storage.retry import RetryPolicy
from ftjob.storage.wrapper import DelegatingFileSystem


class RecordingFileSystem(DelegatingFileSystem):
    """Records every operation; ``fail`` decides, per (op, path), to raise instead."""

    def __init__(
        self, fs: AbstractFileSystem, fail: Callable[[str, str], BaseException | None] | None = None
    ) -> None:
        super().__init__(fs)
        self.fail = fail or (lambda op, path: None)
        self.calls: list[tuple[str, str]] = []

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        self.calls.append((op, path))
        error = self.fail(op, path)
        if error is not None:
            raise error
        return fn()


def no_sleep_policy(max_attempts: int = 3) -> RetryPolicy:
    return RetryPolicy(
        RetryConfig(max_attempts=max_attempts, initial_backoff=0.0, jitter=0.0),
        sleep=lambda s: None,
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


class ScriptedFileSystem(DelegatingFileSystem):
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


def retrying(inner: AbstractFileSystem, fake: FakeTime, **overrides: Any) -> RetryingFileSystem:
    return RetryingFileSystem(inner, policy(fake, **overrides))


def _fake_retry_request(tries: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Like gcsfs's ``retry_request(retries=...)``: the tries are fixed when the class is
    defined, and the undecorated function is ``__wrapped__``."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        def retried(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(tries):
                try:
                    return func(*args, **kwargs)
                except ConnectionResetError:
                    if attempt == tries - 1:
                        raise
            return None

        retried.__wrapped__ = func  # type: ignore[attr-defined]
        return retried

    return decorate


class FakeGCSFileSystem(AbstractFileSystem):
    """Stands in for gcsfs: requests retried 6 times by a decorator, whatever ``retries`` is."""

    protocol = ("gs", "gcs")
    cachable = False
    retries = 6
    sent = 0

    def _send(self) -> None:
        type(self).sent += 1
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    _request = _fake_retry_request(6)(_send)
    _get_file_request = _fake_retry_request(6)(_send)
    _get_file_concurrent = _fake_retry_request(6)(_send)
