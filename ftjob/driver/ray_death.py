"""Ray dying under a run, seen from the driver: the raylet or the GCS server of a Ray the
driver started, ended from outside (the OOM killer, another user's ``ray stop``).

The run ledger lives in that Ray and goes with it, and the driver itself may not outlive it by
much: its Ray core worker ends the process as soon as it next needs the dead raylet's object
store (measured here: 1-3 s after the raylet's SIGKILL, exit code 1, no Python code run). So
the watch waits on the processes themselves -- a pidfd each, readable the moment the process
ends, no polling delay -- and hands the reason to ``on_death`` at once, on its own thread: the
driver writes the run's summary from the record it holds before Ray's own notice of the dead
node can reach it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

from ftjob.ray_internals import RAY_PROCESSES

logger = logging.getLogger("ftjob")
POLL_S = 0.5  # where pidfds are missing (Linux < 5.3): how often /proc is read instead


def death_reason(kind: str, pid: int) -> str:
    """The run's error when Ray's ``kind`` process (``raylet``, ``gcs_server``) ended."""
    what = RAY_PROCESSES.get(kind, kind)
    return (
        f"Ray died under the run: the embedded Ray's {what} (pid {pid}) ended -- killed from "
        "outside (the OOM killer, `ray stop`?); the run ledger and the training workers went "
        "with it. This summary is the driver's copy of the run's record"
    )


class RayDeathWatch:
    """Calls ``on_death(reason)`` once, from its own thread, when one of ``processes``
    (``{kind: pid}``, :func:`ftjob.ray_internals.started_ray_processes`) ends; stopped before
    the driver shuts Ray down itself."""

    def __init__(self, processes: dict[str, int], on_death: Callable[[str], None]) -> None:
        self.processes, self.on_death = processes, on_death
        self.died: str | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="ftjob-ray-death", daemon=True)

    def start(self) -> RayDeathWatch:
        if self.processes:
            self._thread.start()
        return self

    def stop(self) -> None:
        """No more calls once this returns (the driver's own ``ray.shutdown`` comes next)."""
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _watch(self) -> None:
        fds: dict[int, tuple[str, int]] = {}
        try:
            for kind, pid in self.processes.items():
                fds[os.pidfd_open(pid)] = (kind, pid)
        except (OSError, AttributeError):  # no pidfds here (or the process is gone already)
            for fd in fds:
                os.close(fd)
            return self._poll_proc()
        poller = select.poll()
        for fd in [*fds, self._stop_r]:
            poller.register(fd, select.POLLIN)
        try:
            ready = [fd for fd, _ in poller.poll()]
        finally:
            for fd in fds:
                os.close(fd)
        ended = [fds[fd] for fd in ready if fd in fds]
        if ended and self._stop_r not in ready:
            self._died(*ended[0])

    def _poll_proc(self) -> None:
        while not select.select([self._stop_r], [], [], POLL_S)[0]:
            for kind, pid in self.processes.items():
                if not _alive(pid):
                    return self._died(kind, pid)

    def _died(self, kind: str, pid: int) -> None:
        self.died = death_reason(kind, pid)
        try:
            self.on_death(self.died)
        except Exception:  # the thread's boundary: the main thread still ends the run
            logger.exception("writing the record of a run whose Ray died failed")


def _alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie -- ended, not yet reaped by Ray -- is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
