"""The Ray cluster a run uses, and whether the job fits on it.

``ray.*`` picks one of three: an existing cluster (``ray.address``; token authentication
when this machine has a Ray token), a simulated multi-node cluster on this machine
(``ray.local_nodes > 1``: :class:`LocalCluster`, whose killed nodes come back as an
autoscaler's would), or an embedded single-node Ray (``address="local"``, never a stale
cluster from ``/tmp/ray``). :func:`cluster` stops only what it started. While it runs, the
raylet-death dumps Ray prints straight to stdout are folded into one line.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ftjob.config import NODE_KINDS, JobConfig, JobError, RayConfig
from ftjob.driver.machine import Machine, usable_cpus
from ftjob.record import Kill

logger = logging.getLogger("ftjob.driver.cluster")


class _RayNoiseFilter:
    """A stdout wrapper that turns Ray's raylet-death reports (a header plus the dead raylet's
    last 20 log lines, printed straight to stdout by the driver) into one short line, and drops
    its paragraphs on a killed worker process and on a task retried after its node died. The
    ledger already reports every kill and failure; the details stay in Ray's log files."""

    _DUMP_LINE = re.compile(
        r"^\s+(\[state-dump\]|\[\d{4}-\d\d-\d\d [^]]*\] \(raylet\)|\(\d\) )|^\s*$"
    )

    def __init__(self, stream: Any, embedded: bool = False) -> None:
        self.stream = stream
        self.buffer = ""
        self.in_dump = False
        # On an embedded Ray the one raylet is all of Ray: its death is Ray's, said as such.
        self.death = (
            "ray: the embedded Ray's raylet died (Ray itself is gone with it)"
            if embedded
            else "ray: a raylet died (its node is gone)"
        )

    def write(self, text: str) -> int:
        self.buffer += text
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if "A worker died or was killed while executing a task" in line:
            return  # a killed training worker: the ledger's failure line says it
        if "Task failed because the node it was running on is dead" in line:
            return  # a decode task on a killed node, which Ray runs again elsewhere
        if "Raylet is terminated" in line or "marked dead because the detector" in line:
            self.in_dump = True
            self.stream.write(f"[ftjob] {self.death}; details in Ray's session logs\n")
            return
        if self.in_dump and self._DUMP_LINE.match(line):
            return
        self.in_dump = False
        self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def _quiet_ray_console(enabled: bool, embedded: bool = False) -> Iterator[None]:
    if not enabled:
        yield
        return
    original = sys.stdout
    sys.stdout = _RayNoiseFilter(original, embedded)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = original


def _use_token_if_available() -> None:
    """Connect with token authentication when this machine has a Ray token, as `ray start`
    does (Ray 2.60 enables token auth for clusters it starts; a driver joining one must send
    the token, and Ray only does that when RAY_AUTH_MODE=token)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(token_file):
        os.environ["RAY_AUTH_MODE"] = "token"


RAY_CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"


def resolve_address(address: str) -> str | None:
    """``host:port`` of the cluster ``ray.address`` names (``auto``: RAY_ADDRESS, or the cluster
    started last on this machine), None for a Ray Client address (``ray://``)."""
    if address.startswith("ray://"):
        return None
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")
        if not address and os.path.exists(RAY_CURRENT_CLUSTER):
            with open(RAY_CURRENT_CLUSTER) as f:
                address = f.read().strip()
        if not address:
            raise JobError(
                "ray.address='auto': no running Ray cluster found on this machine (no RAY_ADDRESS, "
                f"no {RAY_CURRENT_CLUSTER}): start one with `ray start --head`, set "
                "ray.address=HOST:6379, or ray.address=null for an embedded Ray"
            )
        if address.startswith("ray://"):
            return None
    return address


def probe_cluster(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, with what to do, when nothing answers at ``ray.address`` (Ray itself
    retries for minutes, printing GCS warnings)."""
    target = resolve_address(address)
    if target is None:
        return
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise JobError(
            f"ray.address={address!r}: expected HOST:PORT (e.g. 10.0.0.1:6379), 'auto' or ray://"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        via = "" if target == address else f" (from ray.address={address!r})"
        raise JobError(
            f"ray.address={address!r}: no Ray cluster answers at {target}{via}: {exc}; start one with "
            "`ray start --head`, fix the address, or set ray.address=null for an embedded Ray"
        ) from None


def system_config(r: RayConfig) -> dict[str, Any]:
    """Ray settings for a cluster ftjob starts (null keys: Ray's defaults).

    - ``object_manager_pull_timeout_ms``: a restarted worker on another node pulls the train
      function and the catalogs from a copy Ray picks at random among the nodes that had one --
      a node killed seconds ago stays among them until Ray marks it dead, and Ray asks the next
      copy only after the pull timeout (its default: 10 s, measured as a 10 s gap in node-kill
      recoveries).
    - ``health_check_period_ms`` x ``health_check_failure_threshold``: how long after a node's
      raylet stops answering Ray marks the node dead (its default: 3 s x 5). Until then Ray
      Train may not learn that the node's worker died (a surviving rank waiting in a report
      barrier sees nothing), and its new placement group may wait on the dead node's
      resources; measured here as 16 s detections and 12 s restarts after node kills.

    Existing clusters: the same names as ``RAY_<name>`` on ``ray start`` (the health checks
    on the head node)."""
    settings = {
        "object_manager_pull_timeout_ms": r.object_pull_timeout_ms,
        "health_check_period_ms": r.health_check_period_ms,
        "health_check_failure_threshold": r.health_check_failure_threshold,
    }
    return {key: int(value) for key, value in settings.items() if value is not None}


@contextmanager
def cluster(job: JobConfig) -> Iterator[Any]:
    """Connect to or start the cluster ``job.ray`` describes; yields the LocalCluster (or None).
    Stops only what it started."""
    r = job.ray
    if r.address is not None:
        _use_token_if_available()  # before Ray is imported: it reads RAY_AUTH_MODE once
    import ray

    common: dict[str, Any] = {
        "log_to_driver": r.log_to_driver,
        "logging_level": logging.WARNING if r.log_to_driver else logging.ERROR,
        "runtime_env": dict(r.runtime_env) or None,
    }
    local: LocalCluster | None = None
    embedded = r.address is None and r.local_nodes <= 1
    with _quiet_ray_console(not r.log_to_driver, embedded):
        try:
            if r.address is not None:
                ray.init(address=r.address, **common)
            elif r.local_nodes > 1:
                local = LocalCluster(
                    r.local_nodes,
                    r.node_cpus,
                    r.replace_delay,
                    r.replace_nodes,
                    system_config(r),
                    r.replace_after_steps,
                )
                ray.init(address=local.address, **common)
            else:
                ray.init(
                    address="local",
                    num_cpus=embedded_cpus(job, usable_cpus()),
                    include_dashboard=False,
                    _system_config=system_config(r),
                    **common,
                )
            yield local
        finally:
            ray.shutdown()
            if local is not None:
                local.shutdown()


# `~`: a dict given on the command line is merged into the config's, so `={CPU: 1}` keeps GPU.
_CPU_HINT = "set trainer.use_gpu=false '~trainer.resources_per_worker.GPU' to train on CPUs"


def _starting_workers(job: JobConfig) -> tuple[int, str]:
    """How many workers the group needs to start, and the key that says so (an elastic group
    starts on as few as min_workers and waits for nothing more)."""
    t = job.trainer
    if t.elastic and t.min_workers is not None:  # elastic says it is set
        return t.min_workers, "trainer.min_workers"
    return t.num_workers, "trainer.num_workers"


def _check_gpu_count(job: JobConfig, have: float, where: str = "the cluster has") -> None:
    n, _ = _starting_workers(job)
    need = n * float(job.trainer.resources_per_worker.get("GPU", 1.0))
    if have < need:
        raise JobError(
            f"trainer.use_gpu=true needs {need:g} GPUs but {where} {have:g}: "
            f"{_CPU_HINT}, or connect to a GPU cluster with ray.address"
        )


def check_local_gpus(job: JobConfig) -> None:
    """A cluster ftjob starts here (embedded or simulated) has this machine's GPUs: a GPU job
    on a machine with none is refused before Ray starts, not after a cluster start."""
    if job.ray.address is not None or not job.trainer.use_gpu:
        return
    import torch

    if torch.cuda.device_count() == 0:
        _check_gpu_count(job, 0.0, "this machine (where ftjob starts the cluster) has")


def worker_bundle(job: JobConfig) -> dict[str, float]:
    """What Ray Train reserves for each worker (its ScalingConfig's rule: the non-zero
    ``resources_per_worker``, a GPU added with ``use_gpu``)."""
    t = job.trainer
    bundle = {name: float(v) for name, v in t.resources_per_worker.items() if v}
    if t.use_gpu:
        bundle.setdefault("GPU", 1.0)
    return bundle


def started_nodes(job: JobConfig, machine: Machine) -> tuple[list[dict[str, float]], str]:
    """The nodes of the cluster ftjob starts for ``job`` on ``machine`` (each node of a
    simulated cluster sees the machine's GPUs and memory, as Ray's do), and how to say it."""
    r = job.ray
    shared = {"GPU": float(machine.gpus), "memory": machine.memory}
    if r.local_nodes > 1:
        where = f"the simulated cluster ({r.local_nodes - 1} nodes of ray.node_cpus={r.node_cpus})"
        workers = [{"CPU": float(r.node_cpus), **shared} for _ in range(r.local_nodes - 1)]
        return [{"CPU": 0.0, **shared}, *workers], where
    cpus = embedded_cpus(job, machine.cpus)
    return [{"CPU": float(cpus), **shared}], f"this machine's embedded Ray ({cpus} CPUs)"


def embedded_cpus(job: JobConfig, machine_cpus: int) -> int:
    """The CPUs of the embedded Ray ftjob starts (``ray.num_cpus``, else): training workers
    hold theirs for the whole run, and data decoding needs its own -- the machine's cores,
    and at least one decode task per worker."""
    t = job.trainer
    decode = max(machine_cpus, math.ceil(t.num_workers * t.decode_cpus))
    return int(job.ray.num_cpus or decode + math.ceil(t.num_workers * t.worker_cpus))


def _amount(name: str, value: float) -> str:
    return f"{value / 2**30:.1f} GiB" if name == "memory" else f"{value:g} {name}"


def shortfall(job: JobConfig, nodes: list[dict[str, float]], where: str) -> str | None:
    """Why ``job``'s workers can never all be placed on ``nodes`` (one line naming the key,
    what it needs and what there is), or None when they fit."""
    t, bundle = job.trainer, worker_bundle(job)
    n, key = _starting_workers(job)
    for name, need in bundle.items():
        largest = max((node.get(name, 0.0) for node in nodes), default=0.0)
        if largest < need:
            return (
                f"trainer.resources_per_worker.{name}={need:.12g}: each worker needs "
                f"{_amount(name, need)}, and no node of {where} has that much (the largest: "
                f"{_amount(name, largest)})"
            )
    fits = (
        sum(
            min(math.floor(node.get(name, 0.0) / need + 1e-9) for name, need in bundle.items())
            for node in nodes
        )
        if bundle
        else n
    )
    if fits < n:
        return (
            f"{key}={n}: {n} workers of {bundle} do not fit on {where}, which holds {fits}: lower "
            f"{key} or trainer.resources_per_worker, or add nodes"
        )
    decode = 0.0 if t.decode_in in ("worker", "device") else t.decode_cpus  # no Ray Data task
    have, need_cpu = sum(node.get("CPU", 0.0) for node in nodes), n * (t.worker_cpus + decode)
    if have < need_cpu:
        return (
            f"{where} has {have:g} CPUs; {n} workers x ({t.worker_cpus:g} CPUs "
            f"+ trainer.decode_cpus={decode:g} for their data decoding) need {need_cpu:g}: "
            f"lower {key}, trainer.resources_per_worker.CPU or trainer.decode_cpus, or "
            "decode in the workers (trainer.decode_in=worker)"
        )
    return None


def check_machine(job: JobConfig, machine: Machine | None = None) -> None:
    """Before Ray starts: a cluster ftjob starts here (embedded or simulated) is this machine,
    so a job it can never place is refused now instead of waiting forever; and the memory
    tier's holder (on the driver's node, this machine) cannot reserve more than it has."""
    machine = machine or Machine.here()
    memory = job.checkpoint.memory
    if memory.enabled and memory.max_mb * 2**20 > machine.memory:
        raise JobError(
            f"checkpoint.memory.max_mb={memory.max_mb:g}: more than this machine's memory "
            f"({machine.memory / 2**20:.0f} MB), where the snapshot holder reserves its ring"
        )
    if job.ray.address is not None:
        return
    why = shortfall(job, *started_nodes(job, machine))
    if why is not None:
        raise JobError(why)
    shared = oversubscription(job, machine)
    if shared is not None and not job.ray.oversubscribe:
        raise JobError(
            f"{shared}: lower trainer.num_workers (or trainer.resources_per_worker.CPU), run on "
            "a cluster of that size (ray.address), or set ray.oversubscribe=true to share the "
            "cores anyway (each worker slower, start-up and recoveries much slower)"
        )


def oversubscription(job: JobConfig, machine: Machine) -> str | None:
    """Why the training workers of a cluster ftjob starts here would share this machine's real
    cores (one line naming the key, what they need and the cores), or None. Ray places workers
    by the CPUs it is told of, and ftjob tells the embedded Ray the machine's cores plus the
    workers' (room for decoding), a simulated cluster's nodes what ``ray.node_cpus`` says: a
    check against those passes 32 workers on 2 cores, which start 32 processes that train
    nothing for minutes. On the embedded Ray each worker needs the cores it reserves, at
    least one; on a simulated cluster, whose CPUs are declared, a core for each training
    process."""
    if job.ray.address is not None:
        return None
    t = job.trainer
    if job.ray.local_nodes > 1:
        need, what = float(t.num_workers), "training processes, a core each"
    else:
        each = max(1.0, t.worker_cpus)
        need = t.num_workers * each
        what = f"workers x {each:g} cores (trainer.resources_per_worker.CPU={t.worker_cpus:g})"
    if need <= machine.cpus:
        return None
    return (
        f"trainer.num_workers={t.num_workers}: {t.num_workers} {what} need {need:g} cores, and "
        f"this machine has {machine.cpus} (its CPU affinity and cgroup quota)"
    )


def oversubscribed_note(job: JobConfig, machine: Machine | None = None) -> str:
    """What the run's first line adds when ``ray.oversubscribe`` let its workers share the
    machine's cores: the sharing, said where nobody misses it."""
    if not job.ray.oversubscribe:
        return ""
    shared = oversubscription(job, machine or Machine.here())
    return f" (sharing the cores, ray.oversubscribe=true: {shared})" if shared else ""


def check_resources(
    job: JobConfig,
    echo: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Once connected: refuse a job the cluster can never place, instead of waiting forever.
    On an existing cluster an autoscaler may add nodes: what is pending is asked of it and
    said, and the job gives up after ``ray.resources_timeout`` seconds."""
    import ray

    def alive() -> list[dict[str, float]]:
        return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]

    if job.ray.address is None:
        _check_gpus_on(job, alive())
        why = shortfall(job, alive(), "the cluster")
        if why is not None:
            raise JobError(why)
        return
    n, asked = _starting_workers(job)[0], []

    def ask() -> None:
        asked.append(True)
        _ask_autoscaler([worker_bundle(job)] * n)

    try:
        wait_for_resources(
            job, alive, echo or (lambda line: logger.warning("%s", line)), ask, clock, sleep
        )
    finally:
        if asked:  # a request stands until replaced: leave none behind on the user's cluster
            _ask_autoscaler([])


def _ask_autoscaler(bundles: list[dict[str, float]]) -> None:
    """Ask the autoscaler to hold ``bundles`` (each call replaces the last; [] withdraws)."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def wait_for_resources(
    job: JobConfig,
    nodes: Callable[[], list[dict[str, float]]],
    echo: Callable[[str], None],
    ask: Callable[[], None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    poll_s: float = 5.0,
) -> None:
    """Until ``nodes()`` can hold the job: ask for it once (``ask``), say what is pending
    every minute, give up after ``ray.resources_timeout`` with the last shortfall."""
    timeout, start, said = job.ray.resources_timeout, clock(), -math.inf
    while (why := shortfall(job, nodes(), "the cluster")) is not None:
        waited = clock() - start
        if waited >= timeout:
            raise JobError(
                f"{why}; gave up after waiting {waited:.0f} s for the cluster to grow "
                f"(ray.resources_timeout={timeout:g})"
            )
        if said < 0:
            ask()
        if waited - said >= 60.0 or said < 0:
            echo(
                f"waiting for resources (asked of the cluster's autoscaler): {why}; giving up "
                f"in {timeout - waited:.0f} s (ray.resources_timeout)"
            )
            said = waited
        sleep(min(poll_s, max(0.0, timeout - waited)))


def _check_gpus_on(job: JobConfig, nodes: list[dict[str, float]]) -> None:
    """A GPU job on a cluster ftjob started: enough GPUs, said with what to do instead."""
    t = job.trainer
    if not t.use_gpu:
        return
    _check_gpu_count(job, sum(node.get("GPU", 0.0) for node in nodes))
    per_worker = float(t.resources_per_worker.get("GPU", 1.0))
    largest = max((node.get("GPU", 0.0) for node in nodes), default=0.0)
    if per_worker > largest:
        raise JobError(
            f"trainer.resources_per_worker.GPU={per_worker:g}: no node of the cluster has that "
            f"many GPUs (the largest has {largest:g}): lower it, or {_CPU_HINT}"
        )


def replacement_due(
    kill: Kill, now: float, trained: Sequence[int], delay: float, after_steps: int | None
) -> bool:
    """A simulated cluster's killed node comes back: ``delay`` seconds after it went
    (``ray.replace_delay``) and, with ``after_steps`` (``ray.replace_after_steps``), once the
    group that went on without it -- the attempts after the one the kill hit -- trained that
    many steps (``trained``: each attempt's steps since its restore, by attempt index). The
    steps tie the return to the run's progress: the smaller group has trained, whatever the
    machine's speed or the restart's length."""
    gone = kill.deadline or kill.time  # a preempted node goes at its deadline
    if kill.kind not in NODE_KINDS or now - gone < delay:
        return False
    if after_steps is None:
        return True
    after = 0 if kill.attempt is None else kill.attempt + 1
    return sum(trained[after:]) >= after_steps


class LocalCluster:
    """A simulated multi-node cluster on this machine (``ray.local_nodes=N``): a head node with
    no CPUs (so training never lands on it) and N-1 worker nodes. Killed nodes are replaced
    after ``replace_delay`` seconds (and ``replace_after_steps`` steps), as an autoscaler
    would. ``Cluster.add_node`` must run on the driver's main thread, so the runner calls
    :meth:`service` from there."""

    def __init__(
        self,
        nodes: int,
        node_cpus: int,
        replace_delay: float,
        replace_nodes: bool = True,
        system_config: dict[str, Any] | None = None,
        replace_after_steps: int | None = None,
    ) -> None:
        from ray.cluster_utils import Cluster

        self.node_cpus, self.replace_delay = node_cpus, replace_delay
        self.replace_nodes = replace_nodes
        self.replace_after_steps = replace_after_steps
        head: dict[str, Any] = {"num_cpus": 0, "_system_config": system_config or {}}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(nodes - 1):
            self.cluster.add_node(num_cpus=node_cpus)
        self.replaced: set[int] = set()
        self.replacements = 0

    @property
    def address(self) -> str:
        return self.cluster.address

    def service(self, kills: list[Kill], now: float, trained: Sequence[int] = ()) -> None:
        """Add a node for every node kill whose replacement is due (:func:`replacement_due`;
        ``trained`` from the ledger) and not done yet -- none with ray.replace_nodes=false: a
        cluster without spare capacity."""
        if not self.replace_nodes:
            return
        for i, kill in enumerate(kills):
            if i not in self.replaced and replacement_due(
                kill, now, trained, self.replace_delay, self.replace_after_steps
            ):
                self.replaced.add(i)
                self.cluster.add_node(num_cpus=self.node_cpus)
                self.replacements += 1
                logger.info("local cluster: replaced killed node %s", kill.target.node_id[:12])

    def shutdown(self) -> None:
        try:
            self.cluster.shutdown()
        except Exception as exc:  # dead nodes may refuse a clean stop
            logger.debug("local cluster shutdown: %s", exc)
