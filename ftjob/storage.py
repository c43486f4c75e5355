"""Retrying storage: one retry policy (tenacity) over any fsspec filesystem.

Layers, outermost first::

    RetryingFileSystem(policy)        what Ray Train and ftjob's checkpoint store call
      FaultInjectingFileSystem(rate)  only when chaos.storage.failure_rate > 0
        fsspec filesystem             local, memory, s3 (s3fs), gcs (gcsfs), ...

The retrying layer is handed to Ray Train as a ``pyarrow.fs.PyFileSystem``, so every write,
read and listing of the run's storage goes through the same policy, and it pickles to workers
with that policy. The retry loops below it are switched off by default so that the policy users
configure is the one that acts: s3fs's ``retries`` and botocore's ``total_max_attempts`` are 1
(``checkpoint.storage_options`` can set ``retries`` and ``config_kwargs.retries`` again).
aiohttp still re-sends an idempotent request once when a reused keep-alive connection turns
out closed (RFC 9112); that is connection upkeep, not a retry policy.
"""

from __future__ import annotations

import errno
import io
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import tenacity
from fsspec import AbstractFileSystem

from ftjob.config import ConfigError, RetryConfig, StorageChaosConfig

logger = logging.getLogger("ftjob.storage")

# -- classification ------------------------------------------------------------------------

# Message patterns, matched case-insensitively against "TypeName: message" of each exception in
# the chain (s3fs translates S3 error codes into OSErrors whose message is S3's own text).
TRANSIENT_PATTERNS = (
    r"slow ?down",
    r"reduce your request rate",
    r"throttl",
    r"too ?many ?requests",
    r"\b429\b",
    r"\b50[0234]\b",
    r"service ?unavailable",
    r"internal ?(server )?error",
    r"bad gateway",
    r"gateway time-?out",
    r"request ?time-?out",
    r"timed out",
    r"time-?out",
    r"connection (was )?(reset|refused|aborted|closed)",
    r"reset by peer",
    r"broken pipe",
    r"server ?disconnected",
    r"incomplete ?read",
    r"truncated",
    r"response ?ended prematurely",
    r"payload is not completed",
)
PERMANENT_PATTERNS = (
    r"access ?denied",
    r"forbidden",
    r"\b403\b",
    r"no ?such ?bucket",
    r"bucket does not exist",
    r"invalid ?access ?key",
    r"signature ?does ?not ?match",
    r"expired ?token",
    r"invalid ?credentials",
    r"unable to locate credentials",
    r"not ?authori[sz]ed",
)
# s3fs maps SlowDown/ServiceUnavailable/503 to EBUSY and InternalError/500 to EREMOTEIO.
TRANSIENT_ERRNOS = {
    errno.EBUSY,
    getattr(errno, "EREMOTEIO", errno.EIO),
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.EAGAIN,
}
TRANSIENT_TYPES = (ConnectionError, TimeoutError)
# Bad paths and bad permissions do not heal by waiting.
PERMANENT_TYPES = (
    PermissionError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
)
# By name, so neither botocore nor aiohttp has to be importable; matched against the whole MRO.
TRANSIENT_TYPE_NAMES = (
    # botocore: HTTPClientError is the base of ConnectionClosedError, ReadTimeoutError and
    # ResponseStreamingError; the connection errors below derive from botocore's own
    # ConnectionError (so does SSLError, a certificate problem, deliberately left out).
    "HTTPClientError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ProxyConnectionError",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ResponseParserError",  # s3fs: throttling responses sometimes carry broken XML
    # aiohttp
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "ClientConnectionError",
    "ClientOSError",
    # http.client / urllib3 / fsspec
    "IncompleteRead",
    "ProtocolError",
    "FSTimeoutError",
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def check_rules(rules: tuple[str, ...] | list[str], key: str) -> None:
    """A bad regex in ``retry_on``/``give_up_on`` fails at startup, not at the first error."""
    for rule in rules:
        try:
            re.compile(rule)
        except re.error as exc:
            raise ConfigError(
                key, list(rules), f"{rule!r} is neither an exception type name nor a regex ({exc})"
            ) from None


@dataclass(frozen=True)
class ErrorClassifier:
    """Transient or permanent? User rules (``give_up_on`` then ``retry_on``: exception type
    names or case-insensitive regexes of the message) come before the defaults; anything
    unrecognised is permanent, so surprises fail fast instead of spinning."""

    retry_on: tuple[str, ...] = ()
    give_up_on: tuple[str, ...] = ()

    @staticmethod
    def _matches(rules: tuple[str, ...], exc: BaseException) -> bool:
        text = f"{type(exc).__name__}: {exc}"
        return any(rule in _names(exc) or re.search(rule, text, re.IGNORECASE) for rule in rules)

    def is_transient(self, exc: BaseException) -> bool:
        chain = _chain(exc)
        if any(self._matches(self.give_up_on, e) for e in chain):
            return False
        if any(self._matches(self.retry_on, e) for e in chain):
            return True
        for e in chain:
            # Structured signals first: a message may quote a path ("exp-403/...").
            if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
                return True
            if isinstance(e, PERMANENT_TYPES):
                return False
            if isinstance(e, TRANSIENT_TYPES) or _names(e) & set(TRANSIENT_TYPE_NAMES):
                return True
            if self._matches(PERMANENT_PATTERNS, e):
                return False
            if self._matches(TRANSIENT_PATTERNS, e):
                return True
        return False


# -- policy ---------------------------------------------------------------------------------


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


class stop_after_deadline(tenacity.stop.stop_base):
    """Stop when the next wait would end more than ``deadline`` seconds after the call began
    (one instance per call: it remembers when that call started)."""

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
        self.calls += other.calls
        self.attempts += other.attempts
        self.retries += other.retries
        self.failures += other.failures
        self.not_found += other.not_found
        self.retry_wait_s += other.retry_wait_s

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
            stats.by_kind[name] = OpStats(
                calls=int(d.get("calls", 0)),
                attempts=int(d.get("attempts", 0)),
                retries=int(d.get("retries", 0)),
                failures=int(d.get("failures", 0)),
                not_found=int(d.get("not_found", 0)),
                retry_wait_s=float(d.get("retry_wait_s", 0.0)),
            )
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
        check_rules(self.config.retry_on, f"{RetryConfig._group}.retry_on")
        check_rules(self.config.give_up_on, f"{RetryConfig._group}.give_up_on")
        self.sleep, self.clock = sleep, clock
        self.rng = rng or random.Random()
        self.classifier = ErrorClassifier(
            tuple(self.config.retry_on), tuple(self.config.give_up_on)
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

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
        c = self.config
        stats = stats if stats is not None else OpStats()
        stats.calls += 1
        attempts = 0

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

        def counted() -> Any:
            nonlocal attempts
            attempts += 1
            stats.attempts += 1
            return fn()

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(c.max_attempts)
            | stop_after_deadline(c.deadline, self.clock),
            wait=wait_backoff(c.initial_backoff, c.multiplier, c.max_backoff, c.jitter, self.rng),
            retry=tenacity.retry_if_exception(self.classifier.is_transient),
            before_sleep=before_sleep,
            sleep=self.sleep,
            reraise=True,
        )
        try:
            return retrying(counted)
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


def _one_line(exc: object) -> str:
    text = str(exc).strip().splitlines() if exc is not None else []
    return text[0][:300] if text else ""


def bucket_of(target: str) -> str | None:
    """The bucket of an object-store URL (``s3://bucket/key`` -> ``bucket``), else None."""
    match = re.match(r"^([a-z0-9]+)://([^/]+)", target)
    return match.group(2) if match and match.group(1) not in ("file", "local", "memory") else None


def _with_context(
    exc: BaseException, op: str, target: str, transient: bool, attempts: int
) -> BaseException:
    """The same exception type (errno kept), with the operation, path and bucket in its
    message; the original exception itself when its type cannot be rebuilt from a message."""
    bucket = bucket_of(target)
    where = f"{op} {target}" + (f" (bucket {bucket!r})" if bucket else "")
    verdict = f"gave up after {attempts} attempts" if transient else "permanent error, not retried"
    errno_ = exc.errno if isinstance(exc, OSError) else None
    # OSError(errno, text) prints "[Errno N] text": keep the text, the errno is passed on.
    text = _one_line(exc.strerror if errno_ is not None and exc.strerror else exc)  # type: ignore[union-attr]
    message = f"{text or type(exc).__name__} [storage {where}: {verdict}]"
    try:
        return type(exc)(errno_, message) if errno_ is not None else type(exc)(message)
    except Exception:
        return exc


# -- filesystem wrappers ----------------------------------------------------------------------

# Operation name -> kind (for stats). Anything not listed is inherited from AbstractFileSystem
# and ends up in one of these.
OPERATIONS: dict[str, str] = {
    "pipe_file": "upload",
    "put_file": "upload",
    "cat_file": "download",
    "get_file": "download",
    "ls": "list",
    "find": "list",
    "info": "list",
    "mkdir": "other",
    "makedirs": "other",
    "rmdir": "delete",
    "rm_file": "delete",
    "rm": "delete",
    "mv": "other",
    "cp_file": "other",
    "copy": "other",
}


class _DelegatingFileSystem(AbstractFileSystem):
    """An fsspec filesystem that forwards every operation in OPERATIONS to ``self.fs``
    through :meth:`_call`. Subclasses decide what happens around the call."""

    cachable = False

    def __init__(self, fs: AbstractFileSystem, **kwargs: Any) -> None:
        super().__init__()
        self.fs = fs
        self.protocol = fs.protocol

    def unstrip_protocol(self, name: str) -> str:
        return self.fs.unstrip_protocol(name)

    def _strip_protocol(self, path: Any) -> Any:  # type: ignore[override]
        return self.fs._strip_protocol(path)

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            data = self._call("cat_file", path, lambda: self.fs.cat_file(path))
            return io.BytesIO(data)
        if "a" in mode:
            raise NotImplementedError(f"append mode is not supported on {type(self).__name__}")
        return _UploadOnClose(
            lambda data: self._call("pipe_file", path, lambda: self.fs.pipe_file(path, data))
        )


def _forward(name: str) -> Callable[..., Any]:
    def method(self: _DelegatingFileSystem, path: Any, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self.fs, name)
        # put_file(local, remote): the storage path is the second argument.
        target = args[0] if name == "put_file" and args else path
        return self._call(name, str(target), lambda: inner(path, *args, **kwargs))

    method.__name__ = name
    return method


for _name in OPERATIONS:
    setattr(_DelegatingFileSystem, _name, _forward(_name))


class _UploadOnClose(io.BytesIO):
    """A write handle that uploads its whole content in one (retryable) request on close.

    Leaving a ``with`` block by an exception discards the content: a writer that failed half
    way never publishes half a file."""

    def __init__(self, upload: Callable[[bytes], Any]) -> None:
        super().__init__()
        self._upload = upload

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._upload(data)

    def discard(self) -> None:
        if not self.closed:
            super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()


def innermost(fs: AbstractFileSystem) -> AbstractFileSystem:
    """The filesystem under every ftjob wrapper."""
    while isinstance(fs, _DelegatingFileSystem):
        fs = fs.fs
    return fs


class RetryingFileSystem(_DelegatingFileSystem):
    """Every operation on ``fs`` runs under ``policy``; counts land in ``stats``.

    ``inner_retries`` sets the request retries of the filesystem underneath (s3fs's
    ``retries`` attribute, which is no constructor argument and would be lost in pickling);
    it is a constructor argument here so that it survives the trip to Ray workers."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        policy: RetryPolicy,
        *,
        inner_retries: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fs)
        self.policy = policy
        self.stats = StorageStats()
        self._lock = threading.Lock()
        base = innermost(fs)
        if inner_retries is not None and hasattr(base, "retries"):
            base.retries = inner_retries

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        kind = OPERATIONS.get(op, "other")
        local = OpStats()
        # A missing file is an answer to a read or a listing, but a failure of an upload (no
        # such bucket).
        answers = () if kind == "upload" else (FileNotFoundError,)
        try:
            target = self.fs.unstrip_protocol(path)
            return self.policy.call(fn, op=op, target=target, stats=local, answers=answers)
        finally:
            with self._lock:
                self.stats.kind(kind).merge(local)

    def snapshot_stats(self) -> StorageStats:
        with self._lock:
            copy = StorageStats()
            copy.merge(self.stats)
            return copy


INJECTED_ERRORS: dict[str, Callable[[str], Exception]] = {
    "throttle": lambda p: OSError(
        errno.EBUSY, f"SlowDown: Please reduce your request rate (injected, {p})"
    ),
    "reset": lambda p: ConnectionResetError(
        errno.ECONNRESET, f"Connection reset by peer (injected, {p})"
    ),
    "timeout": lambda p: TimeoutError(errno.ETIMEDOUT, f"Read timed out (injected, {p})"),
    "permanent": lambda p: PermissionError(errno.EACCES, f"AccessDenied (injected, {p})"),
}


def is_checkpoint_upload(op: str, path: str) -> bool:
    """An upload of checkpoint data (``.../checkpoints/step_N/...``), not Ray Train's own
    bookkeeping (storage marker, checkpoint manager snapshot)."""
    return OPERATIONS.get(op) == "upload" and "/checkpoints/step_" in f"/{path}"


class FaultInjectingFileSystem(_DelegatingFileSystem):
    """Fails a seeded fraction of requests before they reach ``fs`` (chaos.storage).

    Transient kinds hit any request, Ray Train's included: the retry layer must absorb them
    wherever they happen. A ``permanent`` fault hits only checkpoint uploads (a write that is
    denied), which ftjob can survive (``checkpoint.max_consecutive_upload_failures``); drawn for
    any other request it is not injected, since a permanent error there only ends the job.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        failure_rate: float,
        errors: list[str],
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(fs)
        self.failure_rate, self.errors, self.seed = failure_rate, list(errors), seed
        self._lock = threading.Lock()
        self.set_stream("main")
        self.injected = 0

    def set_stream(self, name: str) -> None:
        """Draw faults from the stream ``(seed, name)``: each process (a worker of an attempt,
        the controller) gets its own reproducible sequence instead of all repeating one."""
        with self._lock:
            self.rng = random.Random(f"ftjob-storage-chaos:{self.seed}:{name}")

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        with self._lock:
            fail = self.rng.random() < self.failure_rate
            kind = self.rng.choice(self.errors) if fail else None
            if kind == "permanent" and not is_checkpoint_upload(op, path):
                kind = None
            self.injected += kind is not None
        if kind is not None:
            raise INJECTED_ERRORS[kind](f"{op} {path}")
        return fn()


def set_fault_stream(fs: AbstractFileSystem, name: str) -> None:
    """Give the fault injector under ``fs`` (if any) its own stream ``name``."""
    inner: Any = fs
    while isinstance(inner, _DelegatingFileSystem):
        if isinstance(inner, FaultInjectingFileSystem):
            inner.set_stream(name)
            return
        inner = inner.fs


# -- construction -----------------------------------------------------------------------------


class StorageError(RuntimeError):
    """Checkpoint storage is unusable; the message names the path, bucket and what to do."""


INNER_RETRIES_OPTION = "retries"


def split_options(protocol: str, options: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """fsspec options for ``protocol``, and the retries of the filesystem's own retry loop.

    ftjob's policy is the one that retries, so the loops below it are switched off unless
    ``storage_options`` asks otherwise: s3fs's ``retries`` (an attribute, set on the instance;
    1 = one try) and botocore's (``config_kwargs.retries.total_max_attempts``: 1 = one try;
    botocore's ``max_attempts`` would count retries, not tries)."""
    merged = dict(options)
    inner_retries = merged.pop(INNER_RETRIES_OPTION, None)
    if protocol in ("s3", "s3a"):
        inner_retries = 1 if inner_retries is None else int(inner_retries)
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        merged["config_kwargs"] = config
    return merged, inner_retries


def build_filesystem(
    url: str,
    options: dict[str, Any],
    retry: RetryConfig,
    chaos: StorageChaosConfig | None = None,
    seed: int = 0,
) -> tuple[RetryingFileSystem, str]:
    """The retrying filesystem for ``url`` and the path within it."""
    protocol = fsspec.utils.get_protocol(url)
    fsspec_options, inner_retries = split_options(protocol, options)
    inner, path = fsspec.core.url_to_fs(url, **fsspec_options)
    fs: AbstractFileSystem = inner
    if chaos is not None and chaos.failure_rate > 0:
        fs = FaultInjectingFileSystem(inner, chaos.failure_rate, chaos.errors, seed=seed)
    return RetryingFileSystem(fs, RetryPolicy(retry), inner_retries=inner_retries), path


def to_pyarrow(fs: AbstractFileSystem) -> Any:
    """Wrap for Ray Train's ``RunConfig(storage_filesystem=...)``."""
    import pyarrow.fs

    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def preflight(fs: RetryingFileSystem, path: str, key: str = "checkpoint.storage_path") -> None:
    """Write, read back and delete a probe object under ``path``, so a missing bucket, bad
    credentials or a read-only path fail now, in seconds, before Ray starts."""
    url = fs.unstrip_protocol(path)
    bucket = bucket_of(url)
    probe = f"{path.rstrip('/')}/.ftjob-probe-{uuid.uuid4().hex[:12]}"
    try:
        if bucket is None:
            # Object stores have no directories (and s3fs's makedirs would create the bucket).
            fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"ftjob storage probe")
        if fs.cat_file(probe) != b"ftjob storage probe":
            raise StorageError(f"{key}={url!r}: a probe object read back different bytes")
        fs.rm_file(probe)
    except StorageError:
        raise
    except Exception as exc:
        where = f"bucket {bucket!r} of {url!r}" if bucket else repr(url)
        options = f"{key.split('.')[0]}.storage_options"
        if bucket and isinstance(exc, FileNotFoundError):
            hint = f"bucket {bucket!r} does not exist: create it or fix {key}"
        elif isinstance(exc, PermissionError) or re.search(
            "credential|access ?key|signature|token", str(exc), re.IGNORECASE
        ):
            hint = (
                f"no permission to write to {where}: check credentials (AWS_* variables, {options})"
            )
        elif fs.policy.classifier.is_transient(exc):
            hint = (
                f"{where} did not answer after all retries: check the endpoint ({options}."
                "endpoint_url or AWS_ENDPOINT_URL) and the network"
            )
        else:
            hint = f"cannot write to {where}"
        raise StorageError(
            f"{key}={url!r}: {hint} ({type(exc).__name__}: {_one_line(exc)})"
        ) from exc
