"""The run's outputs mirrored into its own storage, ``<checkpoint.storage_path>/<name>/outputs/``.

The Hydra run dir lives on the driver's machine: a KubeRay head pod deleted after the job, a
login node. What a user reads after the run -- summary.json, the console log, timeline.png,
the resolved config (``.hydra/``), a traceback -- is copied beside the run's checkpoints, at
each committed checkpoint (on a thread of its own: the driver's poll of the ledger, and so
training, never waits for it) and at the end. Only files that changed since they were last
copied are sent; text is scrubbed of the run's secrets again on the way. Each write goes
through the retrying filesystem; a file that still fails is said once at the end and copied
again at the next sync -- the run's outcome and its local copy never depend on the mirror.
The loggers' own files kept in the run dir -- CSV and TensorBoard's under ``logs/``, MLflow's
file store ``mlruns/``, W&B's offline runs ``wandb/offline-run-*`` -- go with them, so the
charts outlive the driver's machine too. A driver that stops on an unexpected error copies its
traceback and the line it ended with (:func:`close_open_mirror`). ``python -m ftjob.report``
reads a run back from there (:func:`fetch_outputs`).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ftjob.config.secrets import Redactor
from ftjob.reporting.run_record import RECORD_FILE
from ftjob.reporting.summary import SUMMARY_FILE
from ftjob.storage.errors import is_storage_error
from ftjob.storage.wrapper import innermost
from ftjob.text import shorten

OUTPUTS_DIR = "outputs"  # under the run's directory in its storage
CONSOLE_LOG = "console.log"
HYDRA_DIR = ".hydra"
TRACEBACK_FILE = "traceback.txt"
# What is mirrored from the run dir: these files, every top-level ``*.log`` (the console log,
# Hydra's job log), what ``.hydra/`` holds and the loggers' trees below (where logger.dir and
# logger.mlflow_tracking_uri keep their defaults in the run dir).
MIRRORED_FILES = (
    SUMMARY_FILE,
    RECORD_FILE,  # the driver's record: a driver that did not end leaves its summary there
    "timeline.png",
    TRACEBACK_FILE,
    "sweep_summary.csv",  # a sweep dir's report (ftjob.reporting.sweep)
    "sweep_summary.md",
    "sweep_summary.png",
    "sweep_goodput.png",
    "multirun.yaml",
)
# The loggers' trees under the run dir: CSV and TensorBoard files (logger.dir's default), MLflow's
# file store (logger.mlflow_tracking_uri's default) and W&B's offline runs (for ``wandb sync``;
# an online run is in W&B already). Their files are copied as they are, scrubbed like the rest.
LOGGER_TREES = {"logs": "", "mlruns": "", "wandb": "offline-run-"}  # dir -> its parts' prefix
MAX_DEPTH = 8  # path parts below the run dir (MLflow's metric keys make folders: train/loss)
EARLIER_DIR = "earlier"  # under outputs/: earlier drivers' copies of a continued run, 1, 2, ...
SWEEPS_DIR = "sweeps"  # under checkpoint.storage_path: a sweep's report, by its sweep dir
TEXT_SUFFIXES = (".json", ".jsonl", ".log", ".yaml", ".txt", ".csv", ".md")
# The ledger's line for a committed checkpoint: the moment the mirror is brought up to date.
COMMIT_LINE = re.compile(r"^checkpoint step \d+ committed\b")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def mirrored_files(run_dir: str, links: set[str] | None = None) -> Iterator[str]:
    """Paths relative to ``run_dir`` of what is mirrored, as they are now. A symbolic link is
    never followed -- ``notes.log`` linking to a private file, ``.hydra`` to another folder, a
    run dir that is a working directory full of links (``hydra.run.dir=.``) would otherwise
    send what lies outside the run dir into its storage --: each one met is added to
    ``links`` instead."""
    links = set() if links is None else links
    try:
        top = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    for name in top:
        if name in MIRRORED_FILES or name.endswith(".log"):
            if _regular_file(run_dir, name, links):
                yield name
    hydra = os.path.join(run_dir, HYDRA_DIR)
    if os.path.islink(hydra):
        links.add(HYDRA_DIR)
    elif os.path.isdir(hydra):
        for name in sorted(os.listdir(hydra)):
            if _regular_file(run_dir, f"{HYDRA_DIR}/{name}", links):
                yield f"{HYDRA_DIR}/{name}"
    for tree, prefix in LOGGER_TREES.items():
        yield from _tree_files(run_dir, tree, prefix, links)


def _regular_file(run_dir: str, rel: str, links: set[str]) -> bool:
    """Is ``rel`` a file of the run dir itself (a link is noted in ``links``, never followed)?"""
    path = os.path.join(run_dir, *rel.split("/"))
    if os.path.islink(path):
        links.add(rel)
        return False
    return os.path.isfile(path)


def _tree_files(run_dir: str, tree: str, prefix: str, links: set[str]) -> Iterator[str]:
    """A logger's files under ``run_dir/tree`` (only below children named ``prefix*``): plain
    names only (no hidden ``.trash``, no odd characters), no symbolic links followed (each
    noted in ``links``), at most :data:`MAX_DEPTH` parts deep."""
    top = os.path.join(run_dir, tree)
    if os.path.islink(top):
        links.add(tree)
        return
    if not os.path.isdir(top):
        return
    for here, dirs, files in os.walk(top):
        rel = os.path.relpath(here, run_dir).split(os.sep)
        wanted = [
            d
            for d in dirs
            if plain_name(d)
            and d.startswith(prefix if len(rel) == 1 else "")
            and len(rel) < MAX_DEPTH - 1
        ]
        linked = {d for d in wanted if os.path.islink(os.path.join(here, d))}
        links.update("/".join([*rel, d]) for d in linked)
        dirs[:] = sorted(d for d in wanted if d not in linked)
        if prefix and len(rel) == 1:
            continue  # the files beside those folders (W&B's debug.log links) stay
        for name in sorted(files):
            if plain_name(name) and _regular_file(run_dir, "/".join([*rel, name]), links):
                yield "/".join([*rel, name])


def plain_name(name: str) -> bool:
    """A path part the mirror writes and the report reads back: letters, digits and ``._-``,
    not starting with a dot."""
    return bool(_PLAIN_NAME.match(name))


class OutputsMirror:
    """Copies the run dir's outputs (:func:`mirrored_files`) to ``target`` on ``fs`` (a
    retrying filesystem): what changed since the last copy, when :meth:`request` asks (on the
    mirror's thread) and at :meth:`close` (on the caller's). A ``target`` inside the run dir
    (the default storage, ``<run dir>/checkpoints``) gets no copy: the run dir already lies
    beside its checkpoints, and a copy inside it would put every file there twice --
    ``tensorboard --logdir`` on the run dir showed each run twice, a glob for W&B's offline
    runs found two of one run."""

    def __init__(
        self,
        fs: Any,
        target: str,
        run_dir: str,
        redactor: Redactor,
        fence: Callable[[], None] | None = None,
    ) -> None:
        self.fs, self.target, self.run_dir, self.redactor = fs, target, run_dir, redactor
        # The run's lease fence (raises LeaseLost once another driver took the run), checked
        # before every sync and every file it copies: a driver thawed after a takeover copies
        # nothing over the live driver's outputs.
        self.fence = fence
        self.deposed: str | None = None  # why the mirror stopped copying: the run is another's
        self.local = "file" in _protocols(innermost(fs))
        self.inside = self.local and _within(target, run_dir)
        self.sent: dict[str, tuple[int, int]] = {}  # path -> (mtime_ns, size) last copied
        self.kept_earlier: str | None = None  # where another driver's copy was set aside
        self._looked = False  # for another driver's copy, before the first write
        self.failed: dict[str, str] = {}  # path -> its last error, while it stays unsent
        self.links: set[str] = set()  # symbolic links in the run dir: left out, said at close
        self._lock = threading.Lock()  # one sync at a time
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return str(self.fs.unstrip_protocol(self.target))

    def line(self) -> str:
        """Where a run's outputs are, as the run says it once."""
        if self.inside:
            return (
                f"outputs: {os.path.abspath(self.run_dir)} (checkpoint storage lies inside this "
                "run dir: nothing is copied)"
            )
        return (
            f"outputs: {self.url} (summary, console log, timeline, config, loggers' files: a copy)"
        )

    def start(self) -> OutputsMirror:
        self._thread = threading.Thread(target=self._serve, name="ftjob-outputs", daemon=True)
        self._thread.start()
        with _OPEN_LOCK:
            _OPEN[os.path.abspath(self.run_dir)] = self
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
        if self.inside:
            return 0
        with self._lock:
            if not self._still_ours():
                return 0
            if not self._looked:
                self._looked = True
                self._keep_earlier()
            copied = 0
            for rel in list(mirrored_files(self.run_dir, self.links)):
                local = os.path.join(self.run_dir, rel)
                try:
                    stat = os.lstat(local)
                    seen = (stat.st_mtime_ns, stat.st_size)
                    if self.sent.get(rel) == seen:
                        continue
                    if not self._still_ours():  # before each copy: a takeover mid-sync
                        return copied
                    self._copy(rel, local)
                except (OSError, RuntimeError) as exc:  # StorageError: retries spent
                    self.failed[rel] = f"{type(exc).__name__}: {exc}"
                    continue
                self.sent[rel] = seen
                self.failed.pop(rel, None)
                copied += 1
            return copied

    def _still_ours(self) -> bool:
        """Does the run's lease still say this driver holds the run (no fence: always)?"""
        from ftjob.storage.errors import is_storage_error
        from ftjob.storage.lease import LeaseLost

        if self.deposed is not None:
            return False
        if self.fence is None:
            return True
        try:
            self.fence()
        except LeaseLost as exc:
            self.deposed = str(exc)
            return False
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            self.failed["lease"] = f"the lease could not be read: {type(exc).__name__}: {exc}"
            return False
        self.failed.pop("lease", None)
        return True

    def _keep_earlier(self) -> None:
        """Another driver's copy is here (the run continued after that driver stopped or
        died): its top-level files are copied to ``earlier/N/`` before this driver's replace
        them, and its traceback, which would stand beside this driver's record, is moved
        there. Best effort: a failure leaves the copy as it is."""
        try:
            names = {posixpath.basename(str(p).rstrip("/")) for p in self.fs.ls(self.target)}
        except (OSError, RuntimeError, ValueError):  # nothing there yet: a new run
            return
        top = sorted(n for n in names if n in MIRRORED_FILES or n.endswith(".log"))
        if CONSOLE_LOG not in top and SUMMARY_FILE not in top:
            return
        earlier = posixpath.join(self.target, EARLIER_DIR)
        try:
            count = len(self.fs.ls(earlier)) if EARLIER_DIR in names else 0
            dest = posixpath.join(earlier, str(count + 1))
            if self.local:
                self.fs.makedirs(dest, exist_ok=True)
            for name in top:
                self.fs.pipe_file(
                    posixpath.join(dest, name), self.fs.cat_file(posixpath.join(self.target, name))
                )
            if TRACEBACK_FILE in top:
                self.fs.rm_file(posixpath.join(self.target, TRACEBACK_FILE))
        except (OSError, RuntimeError, ValueError) as exc:
            self.failed[EARLIER_DIR] = f"{type(exc).__name__}: {exc}"
            return
        self.kept_earlier = str(self.fs.unstrip_protocol(dest))

    def _copy(self, rel: str, local: str) -> None:
        # O_NOFOLLOW: a file made a link since it was listed is refused, not followed.
        with os.fdopen(os.open(local, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
            data = f.read()
        data = scrubbed(data, rel, self.redactor)
        path = posixpath.join(self.target, rel)
        if self.local:  # an object store has no directories (and s3fs's would make a bucket)
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)

    def close(self, final: bool = True) -> str | None:
        """The last sync (``final``: not for a driver that lost the run to another), on this
        thread; a line that says what could not be copied, if any."""
        with _OPEN_LOCK:
            if _OPEN.get(os.path.abspath(self.run_dir)) is self:
                del _OPEN[os.path.abspath(self.run_dir)]
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        if final:
            self.sync()
        said = []
        if self.deposed is not None:
            said.append(f"outputs: nothing more copied to {self.url}: {self.deposed}")
        if self.links:
            named = ", ".join(sorted(self.links)[:3]) + (", ..." if len(self.links) > 3 else "")
            said.append(
                f"{len(self.links)} symbolic link(s) in the run dir left out of the copy in "
                f"{self.url} ({named}): a link is never followed out of the run dir"
            )
        if self.failed:
            rel, error = next(iter(self.failed.items()))
            first = shorten((error.strip().splitlines() or [""])[0], 300)
            said.append(
                f"warning: {len(self.failed)} output file(s) could not be copied to {self.url} "
                f"({rel}: {first}); the run dir keeps them"
            )
        return self.redactor.text("; ".join(said)) if said else None


# Started mirrors not closed yet, by run dir: a driver that stops on an error its runner did
# not catch (a bug) is closed by the command line after it wrote the traceback.
_OPEN: dict[str, OutputsMirror] = {}
_OPEN_LOCK = threading.Lock()


def close_open_mirror(run_dir: str, last_line: str | None = None) -> str | None:
    """The run in ``run_dir`` stopped without closing its mirror (an unexpected error): append
    ``last_line`` (the error the command ends with) to its console log, then the mirror's last
    sync -- the traceback, the summary, the console log. A line to say: where the copy is, or
    what could not be copied; None when no mirror was started for ``run_dir``."""
    with _OPEN_LOCK:
        mirror = _OPEN.get(os.path.abspath(run_dir))
    if mirror is None:
        return None
    if last_line is not None:
        append_console(run_dir, mirror.redactor.text(last_line))
    if mirror.inside:
        return mirror.close()
    return mirror.close() or f"outputs: {mirror.url} (a copy, traceback included)"


def finished_run_outputs(
    storage_path: str,
    options: dict[str, Any],
    retry: Any,
    name: str,
    run_dir: str,
    redactor: Redactor,
    say: Callable[[str], None],
    lease_timeout: float = 60.0,
) -> None:
    """``resume=auto`` of a run that is finished: the run's outputs in its storage are those of
    the driver that finished it, kept when they say it succeeded; where that driver left none
    (it died after its last checkpoint, before its final copy) or an outcome it did not see to
    the end, this driver's run dir (its summary: succeeded, ``already_finished``) is copied
    there -- unless a live driver holds the run's lease (one training it on with more epochs):
    those outputs are its own. ``say`` prints a line and appends it to the console log."""
    from ftjob.storage.fs import build_filesystem
    from ftjob.storage.lease import RunLease

    url = posixpath.join(storage_path.rstrip("/"), name, OUTPUTS_DIR)
    fs, target = build_filesystem(url, options, retry)
    mirror = OutputsMirror(fs, target, run_dir, redactor)
    if mirror.inside:  # the finished run's outputs are this run dir's (storage lies inside it)
        return
    try:
        holder = RunLease(fs, posixpath.dirname(target), lease_timeout, run_name=name).holder()
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        say(f"outputs: {mirror.url} left as they are: the run's lease could not be read ({exc})")
        return
    if holder is not None:
        say(
            f"outputs: {mirror.url} left to {holder}, the driver that holds run {name!r} now "
            f"(its lease renewed within checkpoint.lease_timeout={lease_timeout:g} s); if that "
            "driver is gone, run this command again after that time to copy this run dir there"
        )
        return
    if _succeeded_there(fs, target):
        say(f"outputs: {mirror.url} (the run's own, from the driver that finished it: kept)")
        return
    say(f"outputs: {mirror.url} (a copy of this run dir: the finished run's driver left none)")
    warning = mirror.close()
    if mirror.kept_earlier:
        say(f"the earlier driver's copy there: {mirror.kept_earlier}")
    if warning:
        say(warning)


def _succeeded_there(fs: Any, target: str) -> bool:
    try:
        summary = json.loads(fs.cat_file(posixpath.join(target, SUMMARY_FILE)))
    except (OSError, RuntimeError, ValueError):  # none there, or unreadable: write ours
        return False
    return isinstance(summary, dict) and summary.get("status") == "succeeded"


def scrubbed(data: bytes, rel: str, redactor: Redactor) -> bytes:
    """A file's bytes without the run's secrets: text (by its suffix, or a file without one
    that reads as UTF-8: MLflow's params, tags and metrics) scrubbed as text; anything else
    (TensorBoard's events, W&B's run file, a PNG) only where a secret value's bytes appear."""
    name = rel.rsplit("/", 1)[-1]
    if rel.endswith(TEXT_SUFFIXES):
        return redactor.text(data.decode("utf-8", "replace")).encode()
    if "." not in name:
        try:
            return redactor.text(data.decode("utf-8")).encode()
        except UnicodeDecodeError:
            pass
    return redactor.binary(data)


def _within(path: str, run_dir: str) -> bool:
    """Is ``path`` (a local one) the run dir or under it, links resolved?"""
    here = os.path.realpath(run_dir)
    return os.path.commonpath([os.path.realpath(path), here]) == here


def _protocols(fs: Any) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def tee_console(run_dir: str, say: Callable[[str], None]) -> Callable[[str], None]:
    """``say``, each line also appended to ``<run_dir>/console.log`` -- unless standard output
    already goes to that file (a sweep job started by ftjob's launcher)."""
    if _stdout_is_console_log(run_dir):
        return say

    def echo(line: str) -> None:
        say(line)
        append_console(run_dir, line)

    return echo


def _stdout_is_console_log(run_dir: str) -> bool:
    try:
        out, here = os.fstat(sys.stdout.fileno()), os.stat(os.path.join(run_dir, CONSOLE_LOG))
    except (OSError, ValueError, AttributeError):  # stdout without a file (a test's capture)
        return False
    return (out.st_dev, out.st_ino) == (here.st_dev, here.st_ino)


# How a record reads in the console log where the console's own format is unknown (Hydra's).
RECORD_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
_CONSOLE = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


class ConsoleLogRecords(logging.Handler):
    """Log records (a storage request the driver retried, a sweep job's traceback) appended to
    the run dir's console log as the console shows them: the run dir keeps one log, read as
    the console was, where Hydra's job log (``<job>.log``, not made: conf/config.yaml) held
    the records alone -- empty in most runs. A line at a time, no file kept open: a sweep's
    jobs each have their own."""

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self.run_dir = run_dir

    def emit(self, record: logging.LogRecord) -> None:
        try:
            append_console(self.run_dir, self.format(record))
        except Exception:  # logging's rule: a record that cannot be written never stops the run
            self.handleError(record)


def log_to_console_log(run_dir: str) -> None:
    """The root logger's records go to ``run_dir``'s console log too (formatted as on the
    console), instead of an earlier job's of this process -- unless standard output already
    goes to that file (a sweep job of ftjob's launcher: they are there)."""
    root = logging.getLogger()
    for earlier in [h for h in root.handlers if isinstance(h, ConsoleLogRecords)]:
        root.removeHandler(earlier)
    if _stdout_is_console_log(run_dir):
        return
    handler = ConsoleLogRecords(run_dir)
    shown = next(  # as the console shows them (Hydra's handler of standard output)
        (h.formatter for h in root.handlers if getattr(h, "stream", None) in _CONSOLE),
        None,
    )
    handler.setFormatter(shown or logging.Formatter(RECORD_FORMAT))
    root.addHandler(handler)


def append_console(run_dir: str, line: str) -> None:
    """``line`` at the end of the run dir's console log (what the console showed)."""
    try:
        with open(os.path.join(run_dir, CONSOLE_LOG), "a") as f:
            f.write(line + "\n")
    except OSError:  # the console still has it
        pass


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
        for marker in (SUMMARY_FILE, RECORD_FILE, "sweep_summary.md"):
            if fs.isfile(posixpath.join(candidate, marker)):
                return candidate
    return None


def fetch_outputs(fs: Any, root: str, local_dir: str) -> list[str]:
    """Copy the outputs under ``root`` into ``local_dir``; the paths copied. A name that is
    not a plain file name (``..``, a separator) is never followed out of ``local_dir``; only
    ``.hydra/`` and the loggers' trees have folders."""
    copied = []
    for found in sorted(fs.find(root)):
        rel = posixpath.relpath(str(found), root.rstrip("/"))
        parts = rel.split("/")
        if not _fetched(parts):
            continue
        target = os.path.join(local_dir, *parts)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(fs.cat_file(found))
        copied.append(rel)
    return copied


def _fetched(parts: list[str]) -> bool:
    if len(parts) == 1:
        return plain_name(parts[0])
    if parts[0] == HYDRA_DIR:
        return len(parts) == 2 and plain_name(parts[1])
    if parts[0] == EARLIER_DIR:
        return len(parts) == 3 and all(map(plain_name, parts))
    return parts[0] in LOGGER_TREES and len(parts) <= MAX_DEPTH and all(map(plain_name, parts))
