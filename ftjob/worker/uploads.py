"""Checkpoint uploads: the local files of one checkpoint, their commit as one outcome (a storage
error that outlasted the retry policy is a failed outcome, a lost run lease a fatal one), and
the background thread that uploads while training goes on (``checkpoint.upload_mode=async``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.errors import is_storage_error
from ftjob.storage.lease import LeaseLost

logger = logging.getLogger("ftjob.worker.uploads")

CONFIG_FILE = "config.json"


@dataclass
class UploadOutcome:
    step: int
    path: str | None  # the committed checkpoint, None if the upload failed
    error: str | None
    seconds: float
    fatal: bool = False  # the run is another driver's now: no budget, the job stops


def upload_checkpoint(store: CheckpointStore, local_dir: str, step: int) -> UploadOutcome:
    """Commit ``local_dir`` as the checkpoint of ``step`` and remove it. A storage error that
    outlasted the retry policy becomes a failed outcome, a lost run lease a fatal one; any
    other error is a bug and raises."""
    start = time.perf_counter()
    fatal = False
    try:
        path, error = store.commit(local_dir, step), None
    except LeaseLost as exc:
        path, error, fatal = None, str(exc), True
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        path, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return UploadOutcome(step, path, error, time.perf_counter() - start, fatal)


def write_local_checkpoint(local_dir: str, tensors: dict[str, Any], records: dict[str, Any]) -> str:
    """Write one checkpoint's files into ``local_dir``: ``tensors`` with torch.save,
    ``records`` as JSON. A full or unwritable scratch disk raises an OSError that says where
    and how much room there was (the partial directory is removed)."""
    import torch

    try:
        os.makedirs(local_dir, exist_ok=True)
        # Through file objects: a full disk is then an OSError (ENOSPC), not torch's
        # unclassified RuntimeError from its own writer.
        for name, obj in tensors.items():
            with open(os.path.join(local_dir, name), "wb") as f:
                torch.save(obj, f)
        for name, record in records.items():
            with open(os.path.join(local_dir, name), "w") as f:
                json.dump(record, f, indent=1 if name == CONFIG_FILE else None)
    except OSError as exc:
        shutil.rmtree(local_dir, ignore_errors=True)
        parent = os.path.dirname(local_dir)
        try:
            free = f"{shutil.disk_usage(parent).free / 2**20:.0f} MB free there"
        except OSError:
            free = "its disk could not be asked"
        raise OSError(
            exc.errno,
            f"writing checkpoint scratch {local_dir} failed: {exc.strerror or exc} ({free}; "
            "point TMPDIR at a larger disk)",
        ) from exc
    return local_dir


class AsyncUploader:
    """Runs uploads on a background thread, one at a time, so training does not wait.

    ``submit`` blocks only while the previous upload is still running (at most one pending
    checkpoint is held locally). ``drain`` returns finished outcomes -- failures included, so
    none is lost -- and ``close`` waits for the pending upload. An upload that raises (a bug,
    not a storage error) re-raises in the training thread at the next ``submit``/``drain``/``close``.
    """

    def __init__(self, upload: Callable[[str, int], UploadOutcome]) -> None:
        self._upload = upload
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftjob-upload")
        self._pending: Future[UploadOutcome] | None = None
        self._done: list[UploadOutcome] = []

    def wait(self) -> float:
        """Wait for the pending upload; returns the seconds spent waiting."""
        start = time.perf_counter()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._done.append(pending.result())
        return time.perf_counter() - start

    def submit(self, local_dir: str, step: int) -> float:
        waited = self.wait()
        self._pending = self._pool.submit(self._upload, local_dir, step)
        return waited

    def drain(self) -> list[UploadOutcome]:
        if self._pending is not None and self._pending.done():
            self.wait()
        done, self._done = self._done, []
        return done

    def abandon(self) -> None:
        """Stop without waiting (the attempt is ending early): a running upload still ends
        and records its outcome; nothing new starts."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> list[UploadOutcome]:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
        return self.drain()


def prune_quietly(store: CheckpointStore, keep: int) -> None:
    """Retention is housekeeping: a failed delete only costs space, and is said."""
    try:
        store.prune(keep)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        logger.warning("pruning old checkpoints failed: %s", exc)
