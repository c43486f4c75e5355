"""The run's outputs mirrored into its own storage, ``<checkpoint.storage_path>/<name>/outputs/``.

The Hydra run dir lives on the driver's machine: a KubeRay head pod deleted after the job, a
login node. What a user reads after the run -- summary.json, the console log, timeline.png,
the resolved config (``.hydra/``), a traceback -- is copied beside the run's checkpoints, at
each committed checkpoint (on a thread of its own: the driver's poll of the ledger, and so
training, never waits for it) and at the end. Only files that changed since they were last
copied are sent; text is scrubbed of the run's secrets again on the way. Each write goes
through the retrying filesystem; a file that still fails is said once at the end and copied
again at the next sync -- the run's outcome and its local copy never depend on the mirror.
``python -m ftjob.report`` reads a run back from there (:func:`fetch_outputs`).
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ftjob.config.secrets import Redactor
from ftjob.reporting.summary import SUMMARY_FILE
from ftjob.storage.wrapper import innermost

OUTPUTS_DIR = "outputs"  # under the run's directory in its storage
CONSOLE_LOG = "console.log"
HYDRA_DIR = ".hydra"
# What is mirrored from the run dir: these files, every top-level ``*.log`` (the console log,
# Hydra's job log) and what ``.hydra/`` holds. Loggers' files (logs/, mlruns/, wandb/) stay:
# they have their own places (logger.dir, logger.mlflow_tracking_uri, ``wandb sync``).
MIRRORED_FILES = (
    SUMMARY_FILE,
    "timeline.png",
    "traceback.txt",
    "sweep_summary.csv",  # a sweep dir's report (ftjob.reporting.sweep)
    "sweep_summary.md",
    "sweep_summary.png",
    "sweep_goodput.png",
    "multirun.yaml",
)
SWEEPS_DIR = "sweeps"  # under checkpoint.storage_path: a sweep's report, by its sweep dir
TEXT_SUFFIXES = (".json", ".log", ".yaml", ".txt", ".csv", ".md")
# The ledger's line for a committed checkpoint: the moment the mirror is brought up to date.
COMMIT_LINE = re.compile(r"^checkpoint step \d+ committed\b")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def mirrored_files(run_dir: str) -> Iterator[str]:
    """Paths relative to ``run_dir`` of what is mirrored, as they are now."""
    try:
        top = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    for name in top:
        if (name in MIRRORED_FILES or name.endswith(".log")) and os.path.isfile(
            os.path.join(run_dir, name)
        ):
            yield name
    hydra = os.path.join(run_dir, HYDRA_DIR)
    if os.path.isdir(hydra):
        for name in sorted(os.listdir(hydra)):
            if os.path.isfile(os.path.join(hydra, name)):
                yield f"{HYDRA_DIR}/{name}"


class OutputsMirror:
    """Copies the run dir's outputs (:func:`mirrored_files`) to ``target`` on ``fs`` (a
    retrying filesystem): what changed since the last copy, when :meth:`request` asks (on the
    mirror's thread) and at :meth:`close` (on the caller's)."""

    def __init__(self, fs: Any, target: str, run_dir: str, redactor: Redactor) -> None:
        self.fs, self.target, self.run_dir, self.redactor = fs, target, run_dir, redactor
        self.local = "file" in _protocols(innermost(fs))
        self.sent: dict[str, tuple[int, int]] = {}  # path -> (mtime_ns, size) last copied
        self.failed: dict[str, str] = {}  # path -> its last error, while it stays unsent
        self._lock = threading.Lock()  # one sync at a time
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return str(self.fs.unstrip_protocol(self.target))

    def start(self) -> OutputsMirror:
        self._thread = threading.Thread(target=self._serve, name="ftjob-outputs", daemon=True)
        self._thread.start()
        return self

    def request(self) -> None:
        """Bring the mirror up to date soon, without waiting for it."""
        self._wake.set()

    def _serve(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing:
                return
            self.sync()

    def sync(self) -> int:
        """Copy what changed; returns how many files were copied. Never raises for storage."""
        with self._lock:
            copied = 0
            for rel in list(mirrored_files(self.run_dir)):
                local = os.path.join(self.run_dir, rel)
                try:
                    stat = os.stat(local)
                    seen = (stat.st_mtime_ns, stat.st_size)
                    if self.sent.get(rel) == seen:
                        continue
                    self._copy(rel, local)
                except (OSError, RuntimeError) as exc:  # StorageError: retries spent
                    self.failed[rel] = f"{type(exc).__name__}: {exc}"
                    continue
                self.sent[rel] = seen
                self.failed.pop(rel, None)
                copied += 1
            return copied

    def _copy(self, rel: str, local: str) -> None:
        with open(local, "rb") as f:
            data = f.read()
        if rel.endswith(TEXT_SUFFIXES):
            data = self.redactor.text(data.decode("utf-8", "replace")).encode()
        path = posixpath.join(self.target, rel)
        if self.local:  # an object store has no directories (and s3fs's would make a bucket)
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)

    def close(self, final: bool = True) -> str | None:
        """The last sync (``final``: not for a driver that lost the run to another), on this
        thread; a line that says what could not be copied, if any."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        if final:
            self.sync()
        if not self.failed:
            return None
        rel, error = next(iter(self.failed.items()))
        first = (error.strip().splitlines() or [""])[0][:300]
        return self.redactor.text(
            f"warning: {len(self.failed)} output file(s) could not be copied to {self.url} "
            f"({rel}: {first}); the run dir keeps them"
        )


def _protocols(fs: Any) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def tee_console(run_dir: str, say: Callable[[str], None]) -> Callable[[str], None]:
    """``say``, each line also appended to ``<run_dir>/console.log`` -- unless standard output
    already goes to that file (a sweep job started by ftjob's launcher)."""
    path = os.path.join(run_dir, CONSOLE_LOG)
    try:
        out, here = os.fstat(sys.stdout.fileno()), os.stat(path)
        if (out.st_dev, out.st_ino) == (here.st_dev, here.st_ino):
            return say
    except (OSError, ValueError, AttributeError):  # stdout without a file (a test's capture)
        pass

    def echo(line: str) -> None:
        say(line)
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:  # the console still has it
            pass

    return echo


# -- reading a run back -------------------------------------------------------------------------


def sweep_id(sweep_dir: str) -> str:
    """A sweep's name in storage: its dir's last two parts (``multirun/DATE/TIME``:
    ``DATE_TIME``), in letters, digits and ``._-`` only."""
    parts = [p for p in os.path.abspath(sweep_dir).split(os.sep) if p][-2:]
    return re.sub(r"[^A-Za-z0-9._-]", "-", "_".join(parts)).lstrip(".") or "sweep"


def outputs_root(fs: Any, path: str) -> str | None:
    """Where a run's outputs are, given the run's directory or its ``outputs/`` folder (or
    where a sweep's report was copied)."""
    for candidate in (path.rstrip("/"), posixpath.join(path.rstrip("/"), OUTPUTS_DIR)):
        for marker in (SUMMARY_FILE, "sweep_summary.md"):
            if fs.isfile(posixpath.join(candidate, marker)):
                return candidate
    return None


def fetch_outputs(fs: Any, root: str, local_dir: str) -> list[str]:
    """Copy the outputs under ``root`` into ``local_dir``; the paths copied. A name that is
    not a plain file name (``..``, a separator) is never followed out of ``local_dir``."""
    copied = []
    for found in sorted(fs.find(root)):
        rel = posixpath.relpath(str(found), root.rstrip("/"))
        parts = rel.split("/")
        if len(parts) > 2 or not all(_PLAIN_NAME.match(p) or p == HYDRA_DIR for p in parts):
            continue
        target = os.path.join(local_dir, *parts)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(fs.cat_file(found))
        copied.append(rel)
    return copied
