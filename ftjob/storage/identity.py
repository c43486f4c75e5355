"""A run's identity on a shared cluster: its storage and its name, never its name alone.

Two runs may share a name -- sweep jobs given ``name=``, two users' ``baseline`` -- whenever
their storage differs, and a Ray cluster they share must never mix them up: a second run's start
would release the first one's snapshot holders, and the first one's next restore would load the
second one's weights from memory. So whatever ftjob names on a cluster for a run (the memory
tier's holders, Ray Train's run) carries the run's *key*: a digest of the run's storage URL and
of a random id kept in the run's directory (:data:`RUN_ID_FILE`), made at the run's first start.
A resume reads the same id, whichever driver, machine or spelling of the path makes it; another
storage has its own id even where its URL reads the same (another machine's local disk, another
S3 endpoint); and a run directory copied or moved elsewhere gets a key of its own (restores
then read storage, never another run's memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
from dataclasses import dataclass
from typing import Any

RUN_ID_FILE = "run_id.json"  # under the run's directory in its storage
ID = re.compile(r"[0-9a-f]{32}")
KEY = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class RunIdentity:
    """Run ``name`` at its storage, as a cluster knows it: ``key``, 16 hex digits of the
    digest of the run's storage URL and its kept id."""

    name: str
    key: str

    def __post_init__(self) -> None:
        if not KEY.fullmatch(self.key):
            raise ValueError(f"run key {self.key!r}: 16 hex digits")

    @property
    def label(self) -> str:
        """``<name>@<key>``: the run's name on a cluster (no run name holds an ``@``)."""
        return f"{self.name}@{self.key}"


def run_identity(fs: Any, run_path: str, name: str) -> RunIdentity:
    """The identity of run ``name`` at ``run_path`` on ``fs``: its id read from the run's
    directory, or made and kept there at its first start (by exclusive create: the driver
    holds the run's lease, and a second writer would only read the first one's). Raises
    ValueError for a file there that holds no id ftjob wrote."""
    path = posixpath.join(run_path, RUN_ID_FILE)
    try:
        kept = _read(fs, path)
    except FileNotFoundError:
        fs.makedirs(run_path, exist_ok=True)
        try:
            fs.pipe_file(path, json.dumps({"id": secrets.token_hex(16)}).encode(), mode="create")
        except FileExistsError:
            pass
        kept = _read(fs, path)
    where = f"{fs.unstrip_protocol(_resolved(fs, run_path))}\n{kept}"
    return RunIdentity(name, hashlib.sha256(where.encode()).hexdigest()[:16])


def _read(fs: Any, path: str) -> str:
    data = fs.cat_file(path)
    try:
        found = json.loads(data).get("id")
    except (ValueError, AttributeError):
        found = None
    if not isinstance(found, str) or not ID.fullmatch(found):
        raise ValueError(
            f"{path}: not a run id ftjob wrote ({data[:80]!r}); remove it to give the run a "
            "new identity (its snapshot holders on a cluster are then not found: restores read "
            "storage)"
        )
    return found


def _resolved(fs: Any, run_path: str) -> str:
    """``run_path`` as one spelling: a local path with its links resolved."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return os.path.realpath(run_path)
    return run_path.rstrip("/")


__all__ = ["RUN_ID_FILE", "RunIdentity", "run_identity"]
