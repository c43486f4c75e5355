"""A simulated node's death (chaos node kills and preemptions): its raylet and every process
under it die, as with a real node -- not the raylet alone, which left its workers running on
the shared machine (orphans holding their memory; zombies of the run in a collective)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A stand-in raylet: two workers, one with a helper process of its own.
TREE = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
worker = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); "
          "print('up', flush=True); time.sleep(600)", *sleeper]
kids = [subprocess.Popen(worker, stdout=subprocess.PIPE, text=True) for _ in range(2)]
for kid in kids:
    kid.stdout.readline()
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_node_taken_down_leaves_none_of_its_processes():
    from ftjob.chaos.reap import _descendants

    raylet = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in raylet.stdout.readline().split()]
        under = _descendants(raylet.pid)
        assert set(workers) < set(under) and len(under) == 4  # two workers, two helpers
        killer = subprocess.run(
            [sys.executable, "-c", f"from ftjob.chaos.reap import *; take_node_down({raylet.pid})"],
            timeout=60,
        )
        assert killer.returncode == 0  # not one of the node's processes: it lives on
        assert raylet.wait(timeout=30) == -9
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in under) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in under if alive(pid)]
    finally:
        raylet.kill()
        end_all(under if "under" in locals() else [])


def end_all(pids: list[int]) -> None:
    """The test's own processes, if it failed before they were killed."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A stand-in raylet whose one worker arms a reaper, then dies at once (as the reaper actor
# does with a driver killed within the notice).
ARMED = """
import subprocess, sys, time
arm = "from ftjob.chaos.killer import NodeReaper; NodeReaper().arm(1.0)"
subprocess.run([sys.executable, "-c", arm], check=True)
print("armed", flush=True)
time.sleep(600)
"""


def test_a_preempted_node_goes_at_its_deadline_though_what_armed_it_is_gone():
    raylet = subprocess.Popen([sys.executable, "-c", ARMED], stdout=subprocess.PIPE, text=True)
    try:
        assert raylet.stdout.readline() == "armed\n"  # the arming process has ended
        assert raylet.wait(timeout=60) == -9
    finally:
        raylet.kill()


def test_a_reaper_whose_raylet_ended_before_the_deadline_takes_nothing_down():
    # Its pid may be another process's by the deadline (the cluster shut down, a chaos node
    # kill came first): the reaper holds the raylet's pidfd and ends with it.
    from ftjob.chaos import reap

    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", reap.__file__, repr(time.time() + 300), str(raylet.pid)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not holds_pidfd(reaper.pid, raylet.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        raylet.kill()
        raylet.wait(timeout=30)
        _, said = reaper.communicate(timeout=60)  # long before its deadline
        assert reaper.returncode == 0
        assert (
            said
            == f"ftjob reaper: raylet {raylet.pid} ended before its deadline: nothing taken down\n"
        )
    finally:
        raylet.kill()
        reaper.kill()


def holds_pidfd(holder: int, pid: int) -> bool:
    """``holder`` has a pidfd of ``pid`` open (/proc's fdinfo says ``Pid:``)."""
    try:
        names = os.listdir(f"/proc/{holder}/fdinfo")
    except FileNotFoundError:
        return False
    for name in names:
        try:
            with open(f"/proc/{holder}/fdinfo/{name}") as info:
                if f"Pid:\t{pid}\n" in info.read():
                    return True
        except FileNotFoundError:
            continue
    return False
