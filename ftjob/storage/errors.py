"""Which storage errors are transient: an error is classified by what it is, not by what its
text happens to contain -- the errno (those of shared filesystems only when the OS raised them),
the type, the HTTP status or S3 error code a storage client attached, and only then the message,
with the storage paths, URLs and ftjob's own context taken out, so that a run named ``exp-500``
is not a server error.

The retry policy that acts on the verdict lives in :mod:`ftjob.storage.retry`.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass

# Message patterns, matched case-insensitively against "TypeName: message" of each exception in
# the chain (s3fs translates S3 error codes into OSErrors whose message is S3's own text), with
# the paths and URLs in it taken out first (see :func:`message_of`).
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
# A credentials refresh that failed is transient only when it says the network or the token
# server failed; anything else (a revoked grant, a bad key) does not heal by waiting.
REFRESH_TRANSIENT_PATTERNS = (*TRANSIENT_PATTERNS, r"network", r"unreachable", r"temporar")
# s3fs maps SlowDown/ServiceUnavailable/503 to EBUSY and InternalError/500 to EREMOTEIO.
TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.EAGAIN,
} | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
# Shared filesystems (NFS, FUSE mounts of buckets) report a server that went away, a stale file
# handle or a mount that lost its transport with these. They count only for errors the OS
# raised: s3fs turns S3 error codes it does not know into OSError(EIO) with the client's error as
# the cause, and those are judged by what S3 said.
OS_TRANSIENT_ERRNOS = {errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT}
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
    # requests: gcsfs raises ProxyError for a 502
    "ProxyError",
    # google.auth: an HTTP request to the token server failed, or timed out
    "TransportError",
    "TimeoutError",
)
# Errors of storage clients that are not OSErrors (s3fs and gcsfs translate most into OSError),
# and of the credentials behind them.
CLIENT_ERROR_TYPE_NAMES = (
    "BotoCoreError",
    "ClientError",
    "ClientResponseError",
    "HttpError",
    "GoogleAPICallError",
    "GoogleAuthError",
)
# S3 error codes that heal by waiting whatever their HTTP status (RequestTimeout is a 400,
# ConditionalRequestConflict -- concurrent conditional writes to one key -- a 409).
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)


def transient_status(status: int) -> bool | None:
    """An HTTP status's verdict: 408, 429 and 5xx (but 501 Not Implemented) heal by waiting;
    other 4xx (401, 403, 404, 412, ...) do not; anything else says nothing."""
    if status in (408, 429) or (500 <= status <= 599 and status != 501):
        return True
    if 400 <= status <= 599:
        return False
    return None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an error carries, read by duck typing: aiohttp's ``status``
    (``ClientResponseError``, ``ClientHttpProxyError``), gcsfs's and google-api-core's
    ``code``, requests' ``response.status_code``, botocore's ``response`` dict."""
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        value = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    else:
        value = getattr(response, "status_code", None)
    return value if isinstance(value, int) and 100 <= value <= 599 else None


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return error.get("Code") if isinstance(error, dict) else None


def is_storage_error(exc: BaseException) -> bool:
    """Did the storage fail (an OSError, or a storage client's own error, its credentials'
    included), rather than ftjob's code? Callers that tolerate storage failures catch only
    these: a bug must surface."""
    if isinstance(exc, OSError) or type(exc).__name__ == "StorageError":
        return True
    return bool(_names(exc) & set(TRANSIENT_TYPE_NAMES + CLIENT_ERROR_TYPE_NAMES))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


# What ftjob adds to a storage error's message (see _with_context): it names the path and the
# bucket, which are no evidence of what went wrong.
GAVE_UP = "gave up after {attempts} attempts"
NOT_RETRIED = "permanent error, not retried"
_CONTEXT = re.compile(
    r"\s*\[storage .*?: (?:" + GAVE_UP.format(attempts=r"\d+") + "|" + NOT_RETRIED + r")\]"
)
# A quoted path or URL ('/mnt/x', "s3://b/k", 'bucket/key'), then any other word with a slash.
_QUOTED_PATH = re.compile(r"""(['"])(?:[a-zA-Z][\w+.-]*://|[/~.]|[\w.-]+/)[^'"\n]*\1""")
_PATH_WORD = re.compile(r"\S*/\S*")


def message_of(exc: BaseException) -> str:
    """``TypeName: message`` of ``exc`` without the storage paths and URLs in it, nor ftjob's
    own context suffix: what message rules match. A run called ``exp-500`` or a mount at
    ``/mnt/timeout-tests`` says nothing about whether an error heals."""
    text = _CONTEXT.sub("", f"{type(exc).__name__}: {exc}")
    return _PATH_WORD.sub(" ", _QUOTED_PATH.sub(" ", text))


@dataclass(frozen=True)
class ErrorClassifier:
    """Transient or permanent? User rules (``give_up_on`` then ``retry_on``: exception type
    names or case-insensitive regexes of the message, paths left out) come before the
    defaults; anything unrecognised is permanent, so surprises fail fast instead of spinning.

    The defaults read each exception of the chain in turn, outermost first, structured
    signals before its message: errno, type, HTTP status or S3 error code."""

    retry_on: tuple[str, ...] = ()
    give_up_on: tuple[str, ...] = ()

    @staticmethod
    def _matches(rules: tuple[str, ...], exc: BaseException) -> bool:
        text = message_of(exc)
        return any(rule in _names(exc) or re.search(rule, text, re.IGNORECASE) for rule in rules)

    def is_transient(self, exc: BaseException) -> bool:
        chain = _chain(exc)
        if any(self._matches(self.give_up_on, e) for e in chain):
            return False
        if any(self._matches(self.retry_on, e) for e in chain):
            return True
        return self._default(chain)

    def _default(self, chain: list[BaseException]) -> bool:
        from_client = any(_names(e) & set(CLIENT_ERROR_TYPE_NAMES) for e in chain)
        for i, e in enumerate(chain):
            verdict = _structured(e, from_client)
            if verdict is not None:
                return verdict
            if "RefreshError" in _names(e):
                return self._matches(REFRESH_TRANSIENT_PATTERNS, e) or self._default(chain[i + 1 :])
            if self._matches(PERMANENT_PATTERNS, e):
                return False
            if self._matches(TRANSIENT_PATTERNS, e):
                return True
        return False


def _structured(e: BaseException, from_client: bool) -> bool | None:
    """The verdict of ``e``'s errno, type, HTTP status or S3 error code; None if they say
    nothing. ``from_client``: a storage client's error is in the chain."""
    if isinstance(e, OSError) and e.errno is not None:
        if e.errno in TRANSIENT_ERRNOS or (e.errno in OS_TRANSIENT_ERRNOS and not from_client):
            return True
    if isinstance(e, PERMANENT_TYPES):
        return False
    names = _names(e)
    if isinstance(e, TRANSIENT_TYPES) or names & set(TRANSIENT_TYPE_NAMES):
        return True
    if "GoogleAuthError" in names and getattr(e, "retryable", False) is True:
        return True  # google.auth says so (a 5xx or "temporarily_unavailable" from the server)
    if _s3_code(e) in TRANSIENT_S3_CODES:
        return True
    status = http_status(e)
    return transient_status(status) if status is not None else None


__all__ = [
    "GAVE_UP",
    "NOT_RETRIED",
    "ErrorClassifier",
    "http_status",
    "is_storage_error",
    "message_of",
    "transient_status",
]
