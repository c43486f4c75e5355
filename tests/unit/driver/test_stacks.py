"""The stack of a hung worker: read with py-spy from the stopped process before it is killed,
trimmed with the training thread first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ftjob.driver.stacks import capture_and_kill, trim_stack


def test_trimmed_stacks_put_the_training_thread_first():
    dump = "Process 1: python\nPython v3.11\n\nThread 1 (idle)\n    wait (threading.py:1)\n\n"
    dump += "Thread 2 (idle)\n    _train (ftjob/train_loop.py:9)\n"
    out = trim_stack(dump)
    assert out.index("ftjob/train_loop.py") < out.index("threading.py")
    assert len(trim_stack(dump * 500, 1000)) <= 1000


def test_a_stopped_process_gives_its_stack_then_dies():
    code = "import time\ndef stuck_here():\n    while True: time.sleep(0.05)\nstuck_here()\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGSTOP)
        result = capture_and_kill(proc.pid)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.killed
    assert result.stack_source == "py-spy", result.stack
    assert "stuck_here" in result.stack
