"""One writer per run: the fenced lease in the run's storage. Real local storage and the
loopback S3; several drivers as real processes (no Ray)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftjob.config import RetryConfig
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.storage.fs import RetryingFileSystem, build_filesystem
from ftjob.storage.lease import LEASE_DIR, LeaseHeld, LeaseKeeper, LeaseLost, RunLease, generations
from ftjob.storage.retry import RetryPolicy
from ftjob.storage.wrapper import DelegatingFileSystem
from tests.support.storage import no_sleep_policy

REPO = Path(__file__).resolve().parents[3]


def local_fs() -> RetryingFileSystem:
    return RetryingFileSystem(LocalFileSystem(), RetryPolicy(RetryConfig()))


def no_wait(seconds: float) -> None:
    """The watch of an expired lease's beat counter, without the wait."""


def age_by(run: str, generation: int, seconds: float) -> None:
    """Make the holder's last renewal ``seconds`` older, as the store sees it."""
    path = os.path.join(run, LEASE_DIR, f"{generation:09d}.json")
    stamp = os.stat(path).st_mtime - seconds
    os.utime(path, (stamp, stamp))


def test_a_second_driver_is_refused_while_the_first_is_alive(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    first = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    assert first.acquire() is None
    age_by(run, 1, 30)
    second = RunLease(local_fs(), run, timeout=60, owner="host-b:200")
    with pytest.raises(LeaseHeld) as err:
        second.acquire()
    assert "host-a:100" in str(err.value) and "last renewed 30 s ago" in str(err.value)
    first.renew()  # the live driver keeps its hold
    age_by(run, 1, 50)
    with pytest.raises(LeaseHeld, match="last renewed 50 s ago"):
        second.acquire()


def test_age_is_read_on_the_stores_clock_not_the_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host whose clock runs 61 s ahead used to see every live lease as expired.
    run = str(tmp_path / "run")
    RunLease(local_fs(), run, timeout=60, owner="host-a:100").acquire()
    ahead = time.time() + 61
    monkeypatch.setattr(time, "time", lambda: ahead)
    with pytest.raises(LeaseHeld, match="host-a:100"):
        RunLease(local_fs(), run, timeout=60, owner="host-b:200").acquire()


def test_an_expired_lease_is_taken_over_and_said(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    RunLease(local_fs(), run, timeout=60, owner="host-a:100").acquire()
    age_by(run, 1, 61)  # the holder died without releasing
    note = RunLease(local_fs(), run, timeout=60, owner="host-b:200", sleep=no_wait).acquire()
    assert note is not None and "took over run 'run' from host-a:100, silent for 6" in note
    assert generations(local_fs(), os.path.join(run, LEASE_DIR)) == [2]


def test_a_torn_lease_counts_as_held_not_free(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    RunLease(local_fs(), run, timeout=60).acquire()
    Path(run, LEASE_DIR, "000000001.json").write_bytes(b'{"owner": "host-a')  # half a write
    with pytest.raises(LeaseHeld):
        RunLease(local_fs(), run, timeout=60, owner="host-b:200").acquire()


def test_a_released_lease_frees_the_run_at_once(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    first = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    first.acquire()
    first.release()
    second = RunLease(local_fs(), run, timeout=60, owner="host-b:200")
    assert second.acquire() is None
    first.release()  # no longer ours: the new holder's lease stays
    with pytest.raises(LeaseHeld, match="host-b:200"):
        RunLease(local_fs(), run, timeout=60, owner="host-c:300").acquire()


def test_a_lease_of_a_process_of_this_host_that_is_gone_is_taken_over_at_once(
    tmp_path: Path,
) -> None:
    import socket

    run = str(tmp_path / "run")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = f"{socket.gethostname()}:{int(gone.stdout)}"
    RunLease(local_fs(), run, timeout=60, owner=dead).acquire()  # a killed sweep's job
    note = RunLease(local_fs(), run, timeout=60).acquire()  # seconds later
    assert note is not None and "that process is gone" in note
    with pytest.raises(LeaseHeld):  # this very process holds it now: refused
        RunLease(local_fs(), run, timeout=60).acquire()


def test_a_deposed_driver_is_fenced_out_of_commits_prunes_and_renewals(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    old = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    old.acquire()
    fence = pickle.loads(pickle.dumps(old.fence()))  # as the workers get it
    fence()  # still ours
    age_by(run, 1, 61)  # paused past the timeout
    new = RunLease(local_fs(), run, timeout=60, owner="host-b:200", sleep=no_wait)
    new.acquire()
    for call in (fence, old.check, old.renew):
        with pytest.raises(LeaseLost, match=r"held by another driver \(host-b:200"):
            call()
    store = CheckpointStore(local_fs(), run, fence)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "model.pt").write_bytes(b"weights")
    with pytest.raises(LeaseLost):
        store.commit(str(scratch), 10)
    assert store.committed_steps() == []
    old.release()  # not its run any more: nothing changes
    new.check()


def test_a_deleted_or_rewritten_lease_stops_the_holder_saying_what_happened(
    tmp_path: Path,
) -> None:
    run = str(tmp_path / "run")
    lease = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    lease.acquire()
    path = Path(run, LEASE_DIR, "000000001.json")
    path.write_text('{"owner": "someone", "token": "not-ours"}')
    with pytest.raises(LeaseLost, match="generation 1 was removed, or rewritten by another"):
        lease.check()
    path.write_bytes(b'{"owner": "host-a')  # torn
    with pytest.raises(LeaseLost, match="generation 1 is unreadable"):
        lease.check()
    path.unlink()
    with pytest.raises(LeaseLost, match="its lease in .* is gone") as err:
        lease.check()
    assert "another driver" not in str(err.value)


class StaleTimes(DelegatingFileSystem):
    """A shared filesystem whose clients cache file attributes (NFS ``actimeo``) or stamp
    them with their own clock: a lease file's modification time reads two minutes old."""

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        return fn()

    def modified(self, path: str) -> Any:
        stamp = self.fs.modified(path)
        return stamp - timedelta(seconds=120) if "/lease/0" in path else stamp


def test_a_live_holder_behind_stale_modification_times_is_not_taken_over(
    tmp_path: Path,
) -> None:
    run = str(tmp_path / "run")
    holder = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    holder.acquire()
    watched: list[float] = []

    def holder_beats_meanwhile(seconds: float) -> None:
        watched.append(seconds)
        holder.renew()  # a live holder renews every quarter of its timeout

    reader = RunLease(
        StaleTimes(LocalFileSystem()),
        run,
        timeout=60,
        owner="host-b:200",
        sleep=holder_beats_meanwhile,
    )
    with pytest.raises(LeaseHeld, match="beat counter moved while watched"):
        reader.acquire()
    assert watched == [30.0]  # half the timeout: a live holder beats at least once in it
    holder.check()  # still the holder's
    silent = RunLease(
        StaleTimes(LocalFileSystem()), run, timeout=60, owner="host-c:300", sleep=no_wait
    )  # the holder died: the counter stands still
    note = silent.acquire()
    assert note is not None and "still while watched 30 s" in note


def test_a_lease_taken_by_a_third_driver_during_the_watch_is_not_taken_again(
    tmp_path: Path,
) -> None:
    run = str(tmp_path / "run")
    RunLease(local_fs(), run, timeout=60, owner="host-a:100").acquire()
    age_by(run, 1, 61)
    third = RunLease(local_fs(), run, timeout=60, owner="host-c:300", sleep=no_wait)
    watcher = RunLease(
        local_fs(), run, timeout=60, owner="host-b:200", sleep=lambda s: third.acquire()
    )
    with pytest.raises(LeaseHeld, match="taken over by another driver while this one watched"):
        watcher.acquire()
    third.check()  # the third driver holds it


HOLDER_IN_ANOTHER_PID_NAMESPACE = textwrap.dedent(
    """
    import json, os, sys, time
    from ftjob.config import RetryConfig
    from ftjob.storage.fs import build_filesystem
    from ftjob.storage.lease import LeaseKeeper, RunLease

    url, taken = sys.argv[1], set(json.loads(sys.argv[2]))
    while True:  # a pid that no process has in the parent namespace
        child = os.fork()
        if child == 0:
            if os.getpid() in taken:
                os._exit(7)
            fs, run = build_filesystem(url, {}, RetryConfig())
            lease = RunLease(fs, run, timeout=60)
            lease.acquire()
            keeper = LeaseKeeper(lease).start()
            print(f"holding {os.getpid()}", flush=True)
            sys.stdin.readline()
            keeper.stop()
            lease.release()
            os._exit(0)
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        if code != 7:
            sys.exit(code)
    """
)


def test_a_live_driver_in_another_pid_namespace_with_this_hostname_is_not_taken_over(
    tmp_path: Path,
) -> None:
    # Containers share a hostname across pid namespaces (pods with host networking,
    # --hostname): its pid is absent here, yet the driver is alive and training.
    run = str(tmp_path / "run")
    taken = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    holder = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            sys.executable,
            "-c",
            HOLDER_IN_ANOTHER_PID_NAMESPACE,
            run,
            json.dumps(taken),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        assert line.startswith("holding "), holder.communicate(timeout=30)[1]
        pid = int(line.split()[1])
        assert not os.path.exists(f"/proc/{pid}")  # no such process in this namespace
        with pytest.raises(LeaseHeld, match="being trained by another driver"):
            RunLease(local_fs(), run, timeout=60).acquire()
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert RunLease(local_fs(), run, timeout=60).acquire() is None  # released: free at once


# -- real processes --------------------------------------------------------------------------

DRIVER = textwrap.dedent(
    """
    import sys, time
    from ftjob.config import RetryConfig
    from ftjob.storage.lease import LeaseHeld, RunLease
    from ftjob.storage.fs import build_filesystem

    url, options = sys.argv[1], eval(sys.argv[2])
    fs, run = build_filesystem(url, options, RetryConfig())
    lease = RunLease(fs, run, timeout=60)
    print("ready", flush=True)
    at = float(sys.stdin.readline())  # the same instant for every driver
    while time.time() < at:
        pass
    started = time.monotonic()
    try:
        lease.acquire()
    except LeaseHeld as exc:
        print(f"refused {time.monotonic() - started:.2f} {exc}", flush=True)
        sys.exit(0)
    print(f"took {time.monotonic() - started:.2f}", flush=True)
    """
)


def _simultaneous_drivers(url: str, options: dict[str, Any], count: int) -> list[str]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DRIVER, url, repr(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(count)
    ]
    try:
        for proc in procs:  # every interpreter has imported ftjob and built its lease
            assert proc.stdout is not None and proc.stdin is not None
            if proc.stdout.readline() != "ready\n":
                raise AssertionError(proc.communicate(timeout=30)[1])
        at = time.time() + 0.5
        for proc in procs:
            proc.stdin.write(f"{at}\n")
            proc.stdin.flush()
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    return outputs


def check_exactly_one_takes_it(outputs: list[str]) -> None:
    took = [o for o in outputs if o.startswith("took")]
    refused = [o for o in outputs if o.startswith("refused")]
    assert len(took) == 1 and len(refused) == len(outputs) - 1, outputs
    for line in refused:  # in seconds, naming why
        assert float(line.split()[1]) < 10
        assert "another driver" in line


def test_drivers_started_at_the_same_instant_exactly_one_takes_the_run(tmp_path: Path) -> None:
    check_exactly_one_takes_it(_simultaneous_drivers(str(tmp_path / "storage" / "run"), {}, 4))


@pytest.mark.s3
def test_drivers_started_at_the_same_instant_on_s3_exactly_one_takes_the_run(
    s3_endpoint: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/runs/run"
    check_exactly_one_takes_it(_simultaneous_drivers(url, {"endpoint_url": s3_endpoint}, 4))


HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from ftjob.storage.checkpoint import CheckpointStore
    from ftjob.config import RetryConfig
    from ftjob.storage.lease import LeaseKeeper, LeaseLost, RunLease
    from ftjob.storage.fs import build_filesystem

    url, options, scratch = sys.argv[1], eval(sys.argv[2]), sys.argv[3]
    fs, run = build_filesystem(url, options, RetryConfig())
    lease = RunLease(fs, run, timeout=4, owner="paused-driver")
    lease.acquire()
    keeper = LeaseKeeper(lease).start()
    store = CheckpointStore(fs, run, lease.fence())
    step = 0
    while True:
        step += 1
        os.makedirs(scratch, exist_ok=True)
        with open(os.path.join(scratch, "model.pt"), "wb") as f:
            f.write(os.urandom(256))
        try:
            store.commit(scratch, step)
            store.prune(2)
        except LeaseLost as exc:
            print(f"lost at step {step}: {exc}", flush=True)
            sys.exit(3)
        print(f"committed {step}", flush=True)
        time.sleep(0.2)
    """
)


def check_paused_driver_is_fenced(url: str, options: dict[str, Any], tmp_path: Path) -> None:
    fs, run = build_filesystem(url, options, RetryConfig())
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, repr(options), str(tmp_path / "a")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None
        while "committed 3" not in holder.stdout.readline():
            assert holder.poll() is None, holder.stderr.read() if holder.stderr else ""
        os.kill(holder.pid, signal.SIGSTOP)  # a frozen VM, a stopped process
        paused_at = max(CheckpointStore(fs, run).committed_steps())
        time.sleep(5.5)  # past its 4 s lease, on any store clock
        successor = RunLease(fs, run, timeout=4, owner="successor")
        note = successor.acquire()
        assert note is not None and "from paused-driver, silent for" in note
        scratch = tmp_path / "b"
        scratch.mkdir()
        (scratch / "model.pt").write_bytes(b"the successor's weights")
        mine = CheckpointStore(fs, run, successor.fence())
        mine.commit(str(scratch), 1000)
        os.kill(holder.pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=30)
        assert holder.returncode == 3, out
        assert "held by another driver (successor" in out
        # After it woke: not one commit, not one prune.
        assert CheckpointStore(fs, run).committed_steps() == [1000, paused_at, paused_at - 1]
        assert mine.read_file(1000, "model.pt") == b"the successor's weights"
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait()


def test_a_paused_driver_cannot_commit_or_prune_after_another_took_over(tmp_path: Path) -> None:
    check_paused_driver_is_fenced(str(tmp_path / "storage" / "run"), {}, tmp_path)


@pytest.mark.s3
def test_a_paused_driver_on_s3_cannot_commit_or_prune_after_another_took_over(
    s3_endpoint: str, s3_bucket: str, tmp_path: Path
) -> None:
    check_paused_driver_is_fenced(f"s3://{s3_bucket}/run", {"endpoint_url": s3_endpoint}, tmp_path)


# -- renewal ----------------------------------------------------------------------------------


class Outage(DelegatingFileSystem):
    """A store that refuses every request once ``down`` (a transient error, retried)."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self.down = False

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        if self.down:
            raise ConnectionResetError(104, "Connection reset by peer")
        return fn()


def test_a_renewal_under_a_storage_outage_gives_up_well_inside_the_lease() -> None:
    inner = Outage(MemoryFileSystem())
    config = RetryConfig(max_attempts=100, initial_backoff=0.05, max_backoff=1.0, deadline=300)
    lease = RunLease(RetryingFileSystem(inner, RetryPolicy(config)), "/bucket/run", timeout=8)
    lease.acquire()
    keeper = LeaseKeeper(lease)  # renews every 2 s, each renewal bounded to those 2 s
    inner.down = True
    started = time.monotonic()
    keeper.renew_once()
    assert time.monotonic() - started < 4  # not the policy's 300 s deadline
    assert keeper.lost is None  # one failed renewal, well inside the lease: keep training
    inner.down = False
    keeper.renew_once()
    assert keeper.lost is None and lease.beats == 1


def test_a_holder_that_cannot_renew_for_a_whole_timeout_stops() -> None:
    # Past its timeout another driver may take the run: the holder must not train on.
    inner = Outage(MemoryFileSystem())
    run = f"/bucket/run-{os.getpid()}-{time.monotonic_ns()}"
    lease = RunLease(RetryingFileSystem(inner, no_sleep_policy(1)), run, timeout=8)
    lease.acquire()
    now = [0.0]
    keeper = LeaseKeeper(lease, clock=lambda: now[0])
    inner.down = True
    for now[0] in (2.0, 4.0, 6.0):
        keeper.renew_once()
        assert keeper.lost is None
    now[0] = 8.0
    keeper.renew_once()
    assert keeper.lost is not None
    assert "could not be renewed for 8 s (checkpoint.lease_timeout=8 s" in keeper.lost
    assert "Connection reset by peer" in keeper.lost


def test_the_keeper_says_when_the_run_was_taken_over(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    lease = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    lease.acquire()
    keeper = LeaseKeeper(lease)
    age_by(run, 1, 61)
    RunLease(local_fs(), run, timeout=60, owner="host-b:200", sleep=no_wait).acquire()
    keeper.renew_once()
    assert keeper.lost is not None and "host-b:200" in keeper.lost


def test_with_wait_out_a_young_lease_is_waited_out_and_taken_only_if_it_stays_silent(
    tmp_path: Path,
) -> None:
    # resume=auto: a scheduler reruns the command on another machine seconds after the
    # driver died; its lease is 20 s old. Watched until it would have expired, and half a
    # timeout more, instead of refused.
    run = str(tmp_path / "run")
    holder = RunLease(local_fs(), run, timeout=60, owner="host-a:100")
    holder.acquire()
    age_by(run, 1, 20)
    with pytest.raises(LeaseHeld, match="last renewed 20 s ago"):  # without: refused
        RunLease(local_fs(), run, timeout=60, owner="host-b:200").acquire()
    watched: list[float] = []

    def holder_beats_meanwhile(seconds: float) -> None:
        watched.append(seconds)
        holder.renew()

    alive = RunLease(
        local_fs(), run, timeout=60, owner="host-b:200", sleep=holder_beats_meanwhile, wait_out=True
    )
    with pytest.raises(LeaseHeld, match=r"host-a:100\): its beat counter moved while watched"):
        alive.acquire()
    assert len(watched) == 1 and 69 <= watched[0] <= 71  # 60 - 20 + 30
    holder.check()  # still the holder's
    age_by(run, 1, 20)
    gone = RunLease(
        local_fs(), run, timeout=60, owner="host-c:300", sleep=watched.append, wait_out=True
    )
    note = gone.acquire()
    assert note is not None and "took over run 'run' from host-a:100" in note
    assert generations(local_fs(), os.path.join(run, LEASE_DIR)) == [2]
