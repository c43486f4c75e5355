"""A node's death on a simulated cluster: its raylet and every process under it killed, as a
node that dies takes them all. The standard library only: run by path (``python -I -S
reap.py DEADLINE RAYLET``) it is the reaper of a preempted node, a process of its own session
that takes the node down at its deadline whatever becomes of the driver that preempted it."""

from __future__ import annotations

import os
import select
import signal
import sys
import time


def take_node_down(raylet: int, pidfd: int | None = None) -> None:
    """Stop the raylet (it starts no worker meanwhile), SIGKILL every process it started --
    its workers, their helpers -- then the raylet, then this process if it is the node's
    (a chaos task is). ``pidfd``: the raylet's (:func:`os.pidfd_open`), where the caller
    holds one: the signals then reach that process, never one that took its pid later."""

    def raylet_signal(sig: int) -> None:
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(raylet, sig)
        except (ProcessLookupError, PermissionError):
            pass

    raylet_signal(signal.SIGSTOP)
    me = os.getpid()
    under = _descendants(raylet)
    for child in under:
        if child != me:
            _kill(child)
    raylet_signal(signal.SIGKILL)
    if me in under:
        _kill(me)


def _descendants(root: int) -> list[int]:
    """The processes under ``root`` (from /proc: Linux), children before their parents' kill
    could orphan them."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:  # pid (comm) state ppid ...
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # gone meanwhile; not ours to end


def reap(deadline: float, raylet: int) -> str:
    """Take the node of ``raylet`` down at ``deadline`` (UNIX seconds), unless the raylet
    ends first (the cluster shut down, a chaos kill took the node): then nothing, since its
    pid may be another process's by the deadline. What happened, as a line."""
    try:
        pidfd = os.pidfd_open(raylet)
    except ProcessLookupError:
        return f"raylet {raylet} gone before the reaper started: nothing to take down"
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)  # readable once the process has ended
    while (left := deadline - time.time()) > 0:
        if poller.poll(max(1, int(left * 1000))):
            return f"raylet {raylet} ended before its deadline: nothing taken down"
    take_node_down(raylet, pidfd)
    return f"raylet {raylet} and its processes killed at the deadline"


if __name__ == "__main__":
    print(f"ftjob reaper: {reap(float(sys.argv[1]), int(sys.argv[2]))}", file=sys.stderr)
