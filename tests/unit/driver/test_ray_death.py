"""The watch on a Ray the driver started: a process of it that ends is said at once, with its
kind and pid; a watch stopped first says nothing (the driver's own ray.shutdown)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from ftjob.driver import ray_death
from ftjob.driver.ray_death import RayDeathWatch


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _watch(pid: int) -> tuple[RayDeathWatch, list[str], threading.Event]:
    said, seen = [], threading.Event()

    def on_death(reason: str) -> None:
        said.append(reason)
        seen.set()

    return RayDeathWatch({"raylet": pid}, on_death), said, seen


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_killed_raylet_is_said_at_once_with_its_pid(sleeper, monkeypatch, pidfds):
    if not pidfds:  # a kernel without pidfds: /proc is read instead
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    watch, said, seen = _watch(sleeper.pid)
    watch.start()
    os.kill(sleeper.pid, signal.SIGKILL)  # a zombie until reaped: ended all the same
    assert seen.wait(timeout=30)
    watch.stop()
    assert said == [watch.died]
    assert (
        f"Ray died under the run: the embedded Ray's raylet (pid {sleeper.pid}) ended" in (said[0])
    )


def test_a_watch_stopped_before_ray_shuts_down_says_nothing(sleeper):
    watch, said, _ = _watch(sleeper.pid)
    watch.start()
    watch.stop()
    os.kill(sleeper.pid, signal.SIGKILL)
    sleeper.wait()
    assert said == [] and watch.died is None


def test_a_gcs_server_that_ended_is_named_as_such():
    assert "the embedded Ray's GCS server (pid 7) ended" in ray_death.death_reason("gcs_server", 7)
