"""What the driver does to a stalled worker: read its Python stack and end it, on its node.

py-spy reads another process's stack from outside (``--nonblocking``: without pausing it), so
it works on a process that is deadlocked, stuck in a system call or stopped with SIGSTOP --
where an in-process dump (faulthandler) cannot run. Without py-spy the kernel's view
(process state, wait channel) stands in. Then SIGKILL: Ray Train sees the dead worker and
restarts the group from the last committed checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from ftjob.record import Hang, StackCapture, Straggler

MAX_STACK_CHARS = 4000


def trim_stack(text: str, limit: int = MAX_STACK_CHARS) -> str:
    """py-spy's dump, its ftjob threads first (the training thread), cut to ``limit``."""
    head, *threads = text.split("\nThread ")
    blocks = ["Thread " + t for t in threads]
    blocks.sort(key=lambda b: "ftjob" not in b)
    out = "\n".join([head.strip(), *blocks]) if blocks else text
    return out if len(out) <= limit else out[: limit - 20] + "\n... (trimmed)"


def _proc_view(pid: int) -> str:
    """The kernel's view of a process: its state and what it waits on."""
    lines = []
    for name in ("status", "wchan"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                text = f.read()
        except OSError as exc:
            return f"/proc/{pid}: {exc}"
        if name == "status":
            lines += [line for line in text.splitlines() if line.startswith(("Name", "State"))]
        else:
            lines.append(f"wchan: {text or '-'}")
    return "\n".join(lines)


def stack_of(pid: int) -> tuple[str, str]:
    """(stack text, how it was read) of process ``pid`` on this node."""
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("py-spy", path=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
    if exe:
        try:
            out = subprocess.run(
                [exe, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if out.returncode == 0 and out.stdout.strip():
                return trim_stack(out.stdout), "py-spy"
            why = (out.stderr or out.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{type(exc).__name__}: {exc}"
    else:
        why = "py-spy is not installed on this node"
    return f"{why}\n{_proc_view(pid)}", "proc"


def capture_and_kill(pid: int, capture: bool = True) -> StackCapture:
    """Runs on the stalled worker's node: its stack (if ``capture``), then SIGKILL."""
    stack, source = stack_of(pid) if capture else (None, None)
    try:
        os.kill(pid, signal.SIGKILL)
        killed = True
    except ProcessLookupError:
        killed = False  # it ended on its own meanwhile
    return StackCapture(pid=pid, stack=stack, stack_source=source, killed=killed)


def end_stalled_worker(action: Hang | Straggler) -> StackCapture:
    """The driver, on a hang (stack and kill) or a straggler to restart (kill)."""
    from ftjob.placement import run_on_node

    capture = isinstance(action, Hang)
    node = action.node_id or ""
    return run_on_node(node, capture_and_kill, action.pid, capture, timeout=60)
