"""Which storage errors are transient (ftjob.storage.errors): by errno, type, HTTP status and S3
error code, then the message without its paths; user rules first. No network."""

from __future__ import annotations

import errno
import http.client
import os

import aiohttp
import botocore.exceptions as boto
import google.auth.exceptions as google_auth
import pytest
import requests
import yarl
from aiohttp.client_reqrep import RequestInfo
from multidict import CIMultiDict, CIMultiDictProxy
from s3fs.errors import translate_boto_error

from ftjob.config import ConfigError, RetryConfig
from ftjob.storage.errors import ErrorClassifier, is_storage_error
from ftjob.storage.retry import OpStats, RetryPolicy
from tests.support.storage import (
    S3_TARGET,
    FakeTime,
    client_error,
    failing,
    policy,
)

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
    # Message rules alone (no errno, no telling type) read the message without its paths.
    classify = ErrorClassifier().is_transient
    assert not classify(OSError("failed on s3://b/run-503-x/step_1"))
    assert classify(OSError("503 Service Unavailable on s3://b/x"))
    assert not classify(RuntimeError("cannot write /mnt/timeout-tests/x"))
    assert not classify(RuntimeError("cannot write '/mnt/my runs/timeout 500/x'"))
    assert not classify(RuntimeError("upload of ckpt-bucket/exp-500/step_1/model.pt failed"))
    assert classify(RuntimeError("Read timed out writing /mnt/forbidden/x"))
    assert classify(OSError("Service Unavailable for s3://b/access-denied-tests/x"))


def test_user_rules_match_the_message_not_its_paths() -> None:
    quota = RuntimeError("Quota exceeded on s3://b/exp-7/step_1")
    assert ErrorClassifier(retry_on=("quota",)).is_transient(quota)
    assert not ErrorClassifier(retry_on=("exp-7",)).is_transient(quota)
    reset = ConnectionResetError(errno.ECONNRESET, "reset writing /mnt/quota/step_1")
    assert ErrorClassifier(give_up_on=("quota",)).is_transient(reset)


def test_a_described_error_is_classified_by_its_message_not_ftjobs_context() -> None:
    # The error a storage call raises names its target and bucket; callers classify it again.
    fake = FakeTime()
    target = "s3://exp-500/run/checkpoints/step_000000010/model.pt"
    with pytest.raises(RuntimeError) as info:
        policy(fake).call(failing([RuntimeError("Quota exceeded")]), op="pipe_file", target=target)
    assert "bucket 'exp-500'" in str(info.value)
    assert not ErrorClassifier().is_transient(info.value)
    assert not ErrorClassifier(retry_on=("not retried",)).is_transient(info.value)


@pytest.mark.parametrize("code", ["EIO", "ESTALE", "ENOTCONN", "ETIMEDOUT"])
def test_shared_filesystem_errors_are_transient(code: str) -> None:
    # What an NFS server that went away, or a FUSE mount of a bucket, makes the OS raise.
    number = getattr(errno, code)
    error = OSError(number, os.strerror(number), "/mnt/nfs/run/checkpoints/step_1/model.pt")
    assert ErrorClassifier().is_transient(error)
    assert policy(FakeTime()).call(failing([error]), op="put_file", target="/mnt/nfs/x") == "ok"


def test_an_s3_error_s3fs_does_not_know_is_not_transient_for_its_eio() -> None:
    unknown = translate_boto_error(client_error("InvalidObjectName", "Object name is bad", 400))
    assert isinstance(unknown, OSError) and unknown.errno == errno.EIO  # s3fs's fallback
    assert not ErrorClassifier().is_transient(unknown)


def test_concurrent_conditional_writes_on_s3_are_retried() -> None:
    conflict = translate_boto_error(
        client_error(
            "ConditionalRequestConflict",
            "A conflicting conditional operation is currently in progress against this "
            "resource. Please try again.",
            409,
        )
    )
    assert ErrorClassifier().is_transient(conflict)


def test_a_failed_if_none_match_is_an_existing_file_and_not_retried() -> None:
    response = {
        "Error": {
            "Code": "PreconditionFailed",
            "Message": "At least one of the pre-conditions you specified did not hold",
            "Condition": "If-None-Match",
        },
        "ResponseMetadata": {"HTTPStatusCode": 412},
    }
    taken = translate_boto_error(boto.ClientError(response, "PutObject"))
    assert isinstance(taken, FileExistsError)
    fake = FakeTime()
    stats = OpStats()
    with pytest.raises(FileExistsError) as info:
        policy(fake).call(failing([taken]), op="pipe_file", target=S3_TARGET, stats=stats)
    assert S3_TARGET in str(info.value) and info.value.__cause__ is taken
    assert stats.attempts == 1 and fake.sleeps == []


def _response_error(cls: type, status: int, url: str, message: str = "") -> BaseException:
    request = RequestInfo(yarl.URL(url), "POST", CIMultiDictProxy(CIMultiDict()), yarl.URL(url))
    return cls(request, (), status=status, message=message)


class HttpError(Exception):
    """Shaped like gcsfs's HttpError (gcsfs is not installed): a ``code`` and a message that
    ends in it."""

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, f"{message}, {code}"
        super().__init__(self.message)


HTTP_STATUS = {
    # a 502 from a proxy, on a bucket whose name says "forbidden"
    "aiohttp proxy 502": (
        _response_error(
            aiohttp.ClientHttpProxyError, 502, "https://storage.googleapis.com/b/forbidden-x/o"
        ),
        True,
    ),
    "aiohttp 429": (_response_error(aiohttp.ClientResponseError, 429, "https://gcs/b/o"), True),
    "aiohttp 404 at a path saying 503": (
        _response_error(aiohttp.ClientResponseError, 404, "https://gcs/b/run-503/o"),
        False,
    ),
    "aiohttp 403": (_response_error(aiohttp.ClientResponseError, 403, "https://gcs/b/o"), False),
    "aiohttp 401": (_response_error(aiohttp.ClientResponseError, 401, "https://gcs/b/o"), False),
    "gcsfs 503": (HttpError(503, "Backend Error"), True),
    "gcsfs 429": (HttpError(429, "The rate of change requests is too high"), True),
    "gcsfs 401": (HttpError(401, "Invalid Credentials"), False),
    "gcsfs 502 (requests' ProxyError)": (requests.exceptions.ProxyError(), True),
}


@pytest.mark.parametrize(("exc", "transient"), HTTP_STATUS.values(), ids=HTTP_STATUS.keys())
def test_an_http_status_decides_by_its_number(exc: BaseException, transient: bool) -> None:
    assert ErrorClassifier().is_transient(exc) is transient
    assert is_storage_error(exc)


def test_credentials_refresh_errors_are_storage_errors_classified_by_cause() -> None:
    classify = ErrorClassifier().is_transient
    unreachable = google_auth.TransportError("Failed to connect to the token endpoint")
    assert classify(unreachable)
    revoked = google_auth.RefreshError(
        "invalid_grant: Token has been expired or revoked.", {"error": "invalid_grant"}
    )
    assert not classify(revoked)
    server = google_auth.RefreshError(
        "Failed to retrieve http://metadata.google.internal/computeMetadata/v1/instance/"
        "service-accounts/default/token from the metadata service. Status: 503 Response: b''"
    )
    assert classify(server)
    assert classify(google_auth.RefreshError("token endpoint failed", retryable=True))
    assert not classify(
        google_auth.RefreshError("invalid_grant at http://sts/timeout-tests/token: bad key")
    )
    try:
        try:
            raise google_auth.TransportError("connection aborted")
        except google_auth.TransportError as cause:
            raise google_auth.RefreshError("Unable to refresh the access token") from cause
    except google_auth.RefreshError as wrapped:
        assert classify(wrapped)
    for exc in (unreachable, revoked, google_auth.DefaultCredentialsError("no credentials")):
        assert is_storage_error(exc)  # callers that tolerate storage failures catch these
    assert not is_storage_error(ValueError("a bug"))
    # Through the policy: retried, then raised as itself, naming the target.
    fake = FakeTime()
    with pytest.raises(google_auth.TransportError, match="gave up after 3 attempts"):
        policy(fake, max_attempts=3).call(
            failing([unreachable] * 3), op="pipe_file", target="gs://b/run/x"
        )
    with pytest.raises(google_auth.RefreshError, match="not retried"):
        policy(fake).call(failing([revoked]), op="pipe_file", target="gs://b/run/x")


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
