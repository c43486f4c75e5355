"""One writer per run: the lease a driver holds in the run's storage (fake clock, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from ftjob.lease import LeaseHeld, RunLease


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_second_driver_is_refused_while_the_first_is_alive(tmp_path: Path):
    clock, fs, run = Clock(), LocalFileSystem(), str(tmp_path / "run")
    first = RunLease(fs, run, timeout=60, owner="host-a:100", clock=clock)
    assert first.acquire("r") is None
    clock.now += 30
    second = RunLease(fs, run, timeout=60, owner="host-b:200", clock=clock)
    with pytest.raises(LeaseHeld) as err:
        second.acquire("r")
    assert "host-a:100" in str(err.value) and "last heartbeat 30 s ago" in str(err.value)
    clock.now += 20
    first.renew()  # the live driver keeps its hold
    clock.now += 50
    with pytest.raises(LeaseHeld, match="last heartbeat 50 s ago"):
        second.acquire("r")


def test_an_expired_lease_is_taken_over_and_said(tmp_path: Path):
    clock, fs, run = Clock(), LocalFileSystem(), str(tmp_path / "run")
    RunLease(fs, run, timeout=60, owner="host-a:100", clock=clock).acquire("r")
    clock.now += 61  # the holder died without releasing
    note = RunLease(fs, run, timeout=60, owner="host-b:200", clock=clock).acquire("r")
    assert note is not None and "took over run 'r' from host-a:100" in note


def test_a_released_lease_frees_the_run_at_once(tmp_path: Path):
    clock, fs, run = Clock(), LocalFileSystem(), str(tmp_path / "run")
    first = RunLease(fs, run, timeout=60, owner="host-a:100", clock=clock)
    first.acquire("r")
    first.release()
    assert RunLease(fs, run, timeout=60, owner="host-b:200", clock=clock).acquire("r") is None
    first.release()  # no longer ours: the new holder's lease stays
    with pytest.raises(LeaseHeld):
        RunLease(fs, run, timeout=60, owner="host-c:300", clock=clock).acquire("r")


def test_a_lease_of_a_process_of_this_host_that_is_gone_is_taken_over_at_once(tmp_path: Path):
    import socket
    import subprocess
    import sys

    fs, run = LocalFileSystem(), str(tmp_path / "run")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = f"{socket.gethostname()}:{int(gone.stdout)}"
    RunLease(fs, run, timeout=60, owner=dead).acquire("r")  # a killed sweep's job
    note = RunLease(fs, run, timeout=60).acquire("r")  # seconds later
    assert note is not None and "that process is gone" in note
    alive = RunLease(fs, run, timeout=60)  # this very process holds it now: refused
    with pytest.raises(LeaseHeld):
        alive.acquire("r")
