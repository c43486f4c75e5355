"""A whole run in this process: the driver's preparation, a real run ledger, and real training
workers, restarted after a failure the way Ray Train restarts them -- without Ray.

World 1 runs the worker in this process; world 2 or more runs a process a rank, joined in a
gloo process group, the ledger served to them from a manager process. What only Ray can show
(kills, node loss, drains, elastic resizes, hangs the driver finds) stays in the Ray
end-to-end tests; what the workers decide is tested here, in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pickle
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

from ftjob.actors import DirectHandle
from ftjob.config import JobConfig
from ftjob.driver.ledger import RunLedger
from ftjob.driver.runner import Prepared, prepare, run_plan, worker_spec
from ftjob.memory import SnapshotHolder
from ftjob.memory.cluster import LocalHolders
from ftjob.policy.hang import WatchConfig
from ftjob.record import Hang, RunSnapshot, Straggler
from ftjob.reporting.summary import build_summary
from ftjob.reporting.verdict import FitEnd, RunEnd, decide_status
from ftjob.worker.context import TornDown, local_context
from ftjob.worker.loop import Worker, WorkerSpec
from tests.support.summaries import checked

PREEMPTED = "PreemptionError"


@dataclass
class LocalRun:
    """What :func:`run_locally` leaves: the summary as summary.json holds it (checked against
    its types' schema), the ledger's record, the prepared run (storage, names), and each
    failed attempt's error."""

    summary: dict[str, Any]
    snapshot: RunSnapshot
    prep: Prepared
    errors: list[str] = field(default_factory=list)
    watch_actions: list[Hang | Straggler] = field(default_factory=list)  # hangs, stragglers
    lines: list[str] = field(default_factory=list)  # the progress lines the driver prints


class _Locked:
    """An actor a manager serves (the ledger, the snapshot holder): one call at a time, as a
    Ray actor takes them."""

    def __init__(self, cls: type, *args: Any) -> None:
        self._target, self._lock = cls(*args), threading.Lock()

    def call(self, name: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self._target, name)(*args)


class _Actors(BaseManager):
    pass


_Actors.register("Actor", _Locked)


class ProxyHandle:
    """``handle.method.remote(*args)`` over a manager's proxy of :class:`_Locked`."""

    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # unpickling asks before _proxy is set
            raise AttributeError(name)
        proxy = self._proxy

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return proxy.call(name, *args)

        return _Remote()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _error(exc: BaseException) -> str:
    if isinstance(exc, TornDown):
        return f"{PREEMPTED}: the attempt ended after its just-in-time checkpoint"
    return f"{type(exc).__name__}: {exc}"


def _rank_main(
    spec: WorkerSpec, rank: int, world: int, port: int, out: Any, node_per_rank: bool = False
) -> None:
    """One rank of an attempt at world 2 or more, in a process of its own."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        Worker(spec, local_context(spec.ledger, rank, world, node_per_rank)).train()
        out.put((rank, None))
    except BaseException as exc:
        out.put((rank, f"{_error(exc)}\n{traceback.format_exc()}"))


def _rank_context() -> Any:
    """Ranks start as forks of one server process that imported torch and the worker once
    (a fresh interpreter per rank and attempt spends seconds importing them, most of a short
    attempt); the server never runs a torch op or a thread of this process, so its forks are
    as clean as spawned ones. They inherit the server's environment, as it was when the
    session's first attempt at world 2 or more started it: a test's ``monkeypatch.setenv`` does not
    reach them."""
    ctx = multiprocessing.get_context("forkserver")
    # torch._dynamo (the first optimizer or DDP a rank builds imports it) and ray.data.block
    # (the first window decoded in the rank): seconds in every rank of every attempt, where
    # the server imports them once.
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "torch._dynamo", "ray.data.block", "tests.support.local_run"]
    )
    return ctx


class AttemptTimedOut(AssertionError):
    """The ranks of a local attempt neither ended nor failed in time (a collective only some
    ranks entered, say): a bug to see, not a failure to restart from."""


def _attempt(
    spec: WorkerSpec, world: int, timeout: float = 300.0, node_per_rank: bool = False
) -> str | None:
    """One attempt on every rank: the first error (one line and its traceback), or None."""
    if world == 1:
        # As a Ray Train worker unpickles its own: the storage's counters and fault stream
        # are the attempt's, not the driver's.
        spec = dataclasses.replace(spec, fs=pickle.loads(pickle.dumps(spec.fs)))
        try:
            Worker(spec, local_context(spec.ledger)).train()
        except Exception as exc:
            return f"{_error(exc)}\n{traceback.format_exc()}"
        return None
    ctx = _rank_context()
    out, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(spec, rank, world, port, out, node_per_rank), daemon=True
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AttemptTimedOut(f"ranks {sorted(set(range(world)) - set(results))} hung")
        try:
            rank, error = out.get(timeout=1.0)
            results[rank] = error
        except queue.Empty:
            if any(p.exitcode not in (0, None) for p in procs):
                break  # a rank died without a word
        if any(results.values()):
            break  # one rank failed: Ray Train ends the whole group
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=30)
    failed = [e for e in results.values() if e]
    if failed:
        return failed[0]
    return None if len(results) == world else "WorkerGroupError: a rank died without a word"


def run_locally(
    job: JobConfig,
    run_dir: Path,
    *,
    during: Callable[[Any], None] | None = None,
    node_per_rank: bool = False,
) -> LocalRun:
    """Run ``job`` to its end in this process (``trainer.num_workers`` is the local world
    size: 1 in this process, 2 or more in a process a rank), restarting failed attempts up to
    ``failure.max_failures`` and preempted ones up to ``failure.max_preemptions``, as Ray
    Train would. ``during(ledger)`` runs on a thread while the attempts train (a test's stop
    request, say); the ledger is watched for hangs and stragglers as the driver watches it.
    ``node_per_rank`` (world 2 or more): each rank on a node of its own, with its own snapshot
    holder (``node0``, ``node1``, ...)."""
    world = job.trainer.num_workers
    started = time.time()
    prep = prepare(job, str(run_dir))
    args = (run_plan(job, prep), list(job.chaos.fail_at_steps), WatchConfig.from_job(job))
    memory = job.checkpoint.memory
    holder_args = (int(memory.max_mb * 2**20), memory.keep)
    nodes = [f"node{rank}" for rank in range(world)] if node_per_rank else ["local"]
    manager, holders = None, None
    if world == 1:
        handle: Any = DirectHandle(RunLedger(*args))
        if memory.enabled:
            holders = LocalHolders({"local": DirectHandle(SnapshotHolder(*holder_args))})
    else:
        manager = _Actors(ctx=multiprocessing.get_context("fork"))
        manager.start()
        handle = ProxyHandle(manager.Actor(RunLedger, *args))  # type: ignore[attr-defined]
        if memory.enabled:
            holders = LocalHolders(
                {n: ProxyHandle(manager.Actor(SnapshotHolder, *holder_args)) for n in nodes}  # type: ignore[attr-defined]
            )
    spec = worker_spec(job, prep, handle, dict(prep.catalogs), holders)
    if during is not None:
        threading.Thread(target=during, args=(handle,), daemon=True).start()
    # The driver's poll of the ledger for hangs and stragglers (ftjob.driver.monitor); here
    # they are recorded, not acted on.
    actions: list[Hang | Straggler] = []
    watching = threading.Event()
    broken: list[BaseException] = []

    def watch() -> None:
        try:
            while not watching.wait(0.5):
                actions.extend(handle.check_watch.remote(time.time()))
        except BaseException as exc:  # said by run_locally: a silent watch would prove nothing
            broken.append(exc)

    threading.Thread(target=watch, daemon=True).start()
    failures = preemptions = 0
    fit, errors = FitEnd(), []
    try:
        while (error := _attempt(spec, world, node_per_rank=node_per_rank)) is not None:
            errors.append(error)
            first = error.splitlines()[0]
            handle.failure_noticed.remote(time.time(), {0: first})
            preempted = first.startswith(PREEMPTED)
            if preempted and handle.stop_requested.remote():  # the driver was told to stop
                fit = FitEnd(RunEnd.PREEMPTED)
                break
            preemptions, failures = preemptions + preempted, failures + (not preempted)
            if 0 <= job.failure.max_failures < failures:
                fit = FitEnd(RunEnd.FAILURES_EXHAUSTED, first)
                break
            if preempted and 0 <= job.failure.max_preemptions < preemptions:
                fit = FitEnd(RunEnd.PREEMPTIONS_EXHAUSTED, first)
                break
        watching.set()
        snapshot, lines = handle.snapshot.remote(), handle.poll.remote(0)[0]
        if broken:
            raise AssertionError("the hang and straggler watch failed") from broken[0]
    finally:
        watching.set()
        prep.lease.release()
        if manager is not None:
            manager.shutdown()
    f = job.failure
    status, why = decide_status(snapshot, fit, f.max_failures, f.max_preemptions)
    summary = build_summary(
        snapshot,
        name=prep.name,
        status=status,
        error=why,
        wall_time_s=time.time() - started,
        config=prep.public_config,
        driver_storage=prep.fs.snapshot_stats(),
        run_started=started,
    )
    document = checked(json.loads(json.dumps(summary.document())))  # as summary.json holds it
    return LocalRun(document, snapshot, prep, errors, actions, lines)


def stop_when(condition: Any, reason: str = "SIGTERM") -> Any:
    """A driver told to stop (SIGTERM) the moment ``condition(snapshot)`` holds."""

    def during(ledger: Any) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if condition(ledger.snapshot.remote()):
                ledger.request_stop.remote(reason, time.time())
                return
            time.sleep(0.05)

    return during
