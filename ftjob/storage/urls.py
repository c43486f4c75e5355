"""Storage URLs: which are object stores (buckets of keys, no directories) and their bucket.

One rule for the whole of ftjob: the checkpoint store (no ``makedirs`` on object stores, where
s3fs's would cost requests and even re-create a deleted bucket), the storage probe and the
error messages that name a bucket.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})


def is_object_store(protocol: str | Iterable[str]) -> bool:
    """For a protocol, or an fsspec filesystem's tuple of protocol aliases."""
    names = {protocol} if isinstance(protocol, str) else set(protocol)
    return bool(OBJECT_STORES & names)


def bucket_of(url: str) -> str | None:
    """The bucket of an object-store URL (``s3://bucket/key`` -> ``bucket``), else None."""
    match = re.match(r"^([a-z0-9]+)://([^/]+)", url)
    return match.group(2) if match and is_object_store(match.group(1)) else None
