"""Storage URLs: which fsspec backend a URL needs, and whether it is installed -- checked before
Ray starts, without touching the storage."""

from __future__ import annotations

import re

from ftjob.config.rules import ConfigError

# The package that brings each storage backend ftjob names in its errors (fsspec's own message
# names the module).
INSTALL_HINTS = {
    "gs": "pip install 'ftjob[gcs]'",
    "gcs": "pip install 'ftjob[gcs]'",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}


def fsspec_protocol(url: str) -> str:
    """``s3`` for ``s3://b/k``, ``file`` for a plain path (fsspec's rule, without importing it)."""
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    return match.group(1).lower() if match else "file"


def check_backend(url: str, key: str) -> None:
    """The fsspec backend for ``url`` is known and installed (imports the backend's package,
    without touching the storage)."""
    import fsspec

    protocol = fsspec_protocol(url)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(protocol, "install the fsspec package it names")
        raise ConfigError(
            key, url, f"the {protocol}:// backend is not installed ({exc}): {hint}"
        ) from None
    except ValueError:
        raise ConfigError(
            key, url, f"unknown storage protocol {protocol}://: use a path, s3://, gs://, ..."
        ) from None
