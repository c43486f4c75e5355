"""``python -m ftjob`` as a process: run to its end with its summary.json read back, or started in
the background to watch its console and signal it mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.summaries import checked


def run_ftjob(
    args: list[str], tmp_path: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """Run ``python -m ftjob`` in a subprocess with its run dir under tmp_path; returns the
    process and the parsed summary.json, checked against its types' schema (None if it was
    not written)."""
    run_dir = tmp_path / "run"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    summary_path = run_dir / "summary.json"
    summary = checked(json.loads(summary_path.read_text())) if summary_path.exists() else None
    return proc, summary


def ray_temp_dir(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment that sends the temp dir of any Ray a process starts to a dir of the
    test's own (``RAY_TMPDIR``), and the dir Ray creates there when it starts: a process that
    refused its job before Ray started leaves none, however long the refusal took."""
    root = tmp_path / "ray-tmp"
    root.mkdir(parents=True, exist_ok=True)
    return {"RAY_TMPDIR": str(root)}, root / "ray"


def start_ftjob(args: list[str], run_dir: Path, cwd: Path) -> subprocess.Popen[str]:
    """``python -m ftjob`` in the background, its console (stdout and stderr) unbuffered on
    ``stdout``, to watch it and signal it mid-run."""
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ctrl_c_reaches_it,
    )


def ctrl_c_reaches_it() -> None:
    """In a child process, before it starts: SIGINT back to its default. A test suite run in
    the background of a shell (nohup ... &) ignores SIGINT, its children inherit that, and
    Python then never raises KeyboardInterrupt -- a test that sends Ctrl-C would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(proc: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float) -> None:
    """Read ``proc``'s console into ``lines`` until a line holds ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if pattern in line:
            return
    raise AssertionError(f"{pattern!r} never came:\n" + "".join(lines[-40:]))
