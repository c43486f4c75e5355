"""The retry policy for storage requests: how long to wait, when to give up, and what was
counted along the way. Which errors are transient is :mod:`ftjob.storage.errors`' verdict.

Built on tenacity; sleep, clock and rng are injectable so tests run policies without waiting.
The filesystem layers that apply it live in :mod:`ftjob.storage.fs`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import tenacity

from ftjob.config import RetryConfig, check_error_rules
from ftjob.storage.errors import GAVE_UP, NOT_RETRIED, ErrorClassifier
from ftjob.storage.urls import bucket_of

logger = logging.getLogger("ftjob.storage.retry")


class wait_backoff(tenacity.wait.wait_base):
    """initial * multiplier**(retry-1), scaled by 1 +- jitter (from rng), capped at maximum:
    ``max_backoff`` is the longest any one wait lasts, jitter included."""

    def __init__(
        self, initial: float, multiplier: float, maximum: float, jitter: float, rng: random.Random
    ) -> None:
        self.initial, self.multiplier, self.maximum = initial, multiplier, maximum
        self.jitter, self.rng = jitter, rng

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        try:
            base = min(
                self.maximum, self.initial * self.multiplier ** (retry_state.attempt_number - 1)
            )
        except OverflowError:
            base = self.maximum
        jittered = base * (1 + self.rng.uniform(-self.jitter, self.jitter))
        return min(self.maximum, max(0.0, jittered))


class stop_before_deadline(tenacity.stop.stop_base):
    """Stop before a retry whose wait would end more than ``deadline`` seconds after the call
    began (``None``: no deadline). tenacity's ``stop_before_delay``, but on the policy's
    injectable clock (tests run it without waiting), and a retry whose wait ends exactly at the
    deadline is still made. One instance per call: it remembers when that call started."""

    def __init__(self, deadline: float | None, clock: Callable[[], float]) -> None:
        self.deadline, self.clock = deadline, clock
        self.start = clock()

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        if self.deadline is None:
            return False
        upcoming = retry_state.upcoming_sleep or 0.0
        return self.clock() - self.start + upcoming > self.deadline


@dataclass
class OpStats:
    """Counts for one kind of storage operation. ``failures`` are calls that failed after the
    policy gave up (or at once, on a permanent error); ``not_found`` are reads answered "no
    such file" -- an answer, not a failure (a fresh run lists checkpoints that do not exist)."""

    calls: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    not_found: int = 0
    retry_wait_s: float = 0.0

    def merge(self, other: OpStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> OpStats:
        zero = cls()  # each count's type, from its default
        return cls(
            **{f.name: type(getattr(zero, f.name))(data.get(f.name, 0)) for f in fields(cls)}
        )

    def as_dict(self) -> dict[str, float]:
        ok = self.calls - self.failures
        return {
            "calls": self.calls,
            "attempts": self.attempts,
            "retries": self.retries,
            "failures": self.failures,
            "not_found": self.not_found,
            "retry_wait_s": round(self.retry_wait_s, 4),
            "success_rate": round(ok / self.calls, 6) if self.calls else 1.0,
        }


@dataclass
class StorageStats:
    by_kind: dict[str, OpStats] = field(default_factory=dict)

    def kind(self, name: str) -> OpStats:
        return self.by_kind.setdefault(name, OpStats())

    def merge(self, other: StorageStats) -> None:
        for name, stats in other.by_kind.items():
            self.kind(name).merge(stats)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: self.by_kind[name].as_dict() for name in sorted(self.by_kind)}

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, float]]) -> StorageStats:
        stats = cls()
        for name, d in data.items():
            stats.by_kind[name] = OpStats.from_dict(d)
        return stats


class RetryPolicy:
    """Runs a storage call, retrying transient errors with exponential backoff and jitter.

    ``sleep``, ``clock`` and ``rng`` are injectable, so tests run the policy without waiting.
    Pickling keeps the config only: an unpickled policy sleeps, times and draws jitter for real.
    """

    def __init__(
        self,
        config: RetryConfig | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or RetryConfig()
        check_error_rules(self.config.retry_on, f"{RetryConfig._group}.retry_on")
        check_error_rules(self.config.give_up_on, f"{RetryConfig._group}.give_up_on")
        self.sleep, self.clock = sleep, clock
        self.rng = rng or random.Random()
        self.classifier = ErrorClassifier(
            tuple(self.config.retry_on), tuple(self.config.give_up_on)
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        RetryPolicy.__init__(self, state["config"])

    def call(
        self,
        fn: Callable[[], Any],
        *,
        op: str,
        target: str,
        stats: OpStats | None = None,
        answers: tuple[type[BaseException], ...] = (),
    ) -> Any:
        """``fn()`` under the policy. Every retry is logged once (op, target, attempt, error,
        next wait). The error that ends the call is re-raised as its own type, with the
        operation, the target and its bucket added to the message; ``answers`` are errors
        that count in ``stats.not_found`` instead of ``stats.failures``."""
        stats = stats if stats is not None else OpStats()
        stats.calls += 1
        attempts = 0

        def counted() -> Any:
            nonlocal attempts
            attempts += 1
            stats.attempts += 1
            return fn()

        try:
            return self._retrying(op, target, stats)(counted)
        except Exception as exc:
            if isinstance(exc, answers):
                stats.not_found += 1
            else:
                stats.failures += 1
            transient = self.classifier.is_transient(exc)
            if transient:  # permanent errors (a missing file, say) are often expected by callers
                logger.error(
                    "storage %s %s failed after %d attempts: %s: %s",
                    op,
                    target,
                    attempts,
                    type(exc).__name__,
                    _one_line(exc),
                )
            described = _with_context(exc, op, target, transient, attempts)
            if described is exc:
                raise
            raise described from exc

    def _retrying(self, op: str, target: str, stats: OpStats) -> tenacity.Retrying:
        """One call's tenacity loop; each retry is counted in ``stats`` and logged once."""
        c = self.config

        def before_sleep(state: tenacity.RetryCallState) -> None:
            wait = state.upcoming_sleep or 0.0
            stats.retries += 1
            stats.retry_wait_s += wait
            exc = state.outcome.exception() if state.outcome else None
            logger.warning(
                "storage retry: %s %s failed on attempt %d/%d (%s: %s); next try in %.2fs",
                op,
                target,
                state.attempt_number,
                c.max_attempts,
                type(exc).__name__,
                _one_line(exc),
                wait,
            )

        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(c.max_attempts)
            | stop_before_deadline(c.deadline, self.clock),
            wait=wait_backoff(c.initial_backoff, c.multiplier, c.max_backoff, c.jitter, self.rng),
            retry=tenacity.retry_if_exception(self.classifier.is_transient),
            before_sleep=before_sleep,
            sleep=self.sleep,
            reraise=True,
        )


def _one_line(exc: object) -> str:
    text = str(exc).strip().splitlines() if exc is not None else []
    return text[0][:300] if text else ""


def _with_context(
    exc: BaseException, op: str, target: str, transient: bool, attempts: int
) -> BaseException:
    """The same exception type (errno kept), with the operation, path and bucket in its
    message; the original exception itself when its type cannot be rebuilt from a message."""
    bucket = bucket_of(target)
    where = f"{op} {target}" + (f" (bucket {bucket!r})" if bucket else "")
    verdict = GAVE_UP.format(attempts=attempts) if transient else NOT_RETRIED
    errno_ = exc.errno if isinstance(exc, OSError) else None
    # OSError(errno, text) prints "[Errno N] text": keep the text, the errno is passed on.
    told = exc.strerror if isinstance(exc, OSError) and errno_ is not None else None
    text = _one_line(told or exc)
    message = f"{text or type(exc).__name__} [storage {where}: {verdict}]"
    try:
        return type(exc)(errno_, message) if errno_ is not None else type(exc)(message)
    except Exception:
        return exc
