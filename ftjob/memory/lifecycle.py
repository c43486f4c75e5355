"""The driver's side of the memory tier's holders (:mod:`ftjob.memory.cluster`): one
on every node that can run training ranks at the start, claimed while the driver runs,
released when the run ends.

A run that continues (``resume=true``, ``resume=auto`` that found a checkpoint) keeps the
holders a previous driver of the run left on a cluster that lived on: its workers restore from
them when they hold a state newer than storage's. A run that starts afresh releases any holder
of its identity first: what they hold is not this run's. Holders are the run's by its identity
(its name and storage, :mod:`ftjob.storage.identity`): another run of the same name never
touches them. Either way the driver fences every holder
with its lease generation before its workers start (:mod:`ftjob.memory.fence`), and at
the end releases none that a newer driver of the run has fenced since.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from ftjob.actors import call
from ftjob.config import MemoryConfig
from ftjob.memory.cluster import RunHolders
from ftjob.memory.holder import SnapshotHolder
from ftjob.memory.traffic import RunTraffic
from ftjob.storage.identity import RunIdentity

logger = logging.getLogger("ftjob")


def training_nodes() -> list[str]:
    """Alive nodes that can run a training rank (with CPUs or GPUs: not a head without)."""
    import ray

    return sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)
    )


def claim_interval(orphan_timeout_s: float) -> float:
    """How often the driver claims its holders: several times within their orphan time."""
    return min(orphan_timeout_s / 4, 30.0)


@contextlib.contextmanager
def held_snapshots(
    run: RunIdentity,
    memory: MemoryConfig,
    continues: bool,
    echo: Callable[[str], None],
    generation: int | None = None,
    check_lease: Callable[[], None] = lambda: None,
) -> Iterator[RunHolders | None]:
    """The run's holders while the run trains (None: the tier is off), fenced by the run
    lease's ``generation`` (None: the run has no lease); released after. A holder that refuses
    the fence knows a newer generation: ``check_lease()`` raises where another driver holds
    the run (this one is deposed: it stops before its workers start); where the lease is still
    this driver's (its storage started over beside holders that outlived it), that holder is
    released."""
    if not memory.enabled:
        yield None
        return
    holders = RunHolders(run, int(memory.max_mb * 2**20), memory.keep, memory.orphan_timeout_s)
    found = holders.release() if not continues else len(holders.held())
    if found:
        echo(
            f"memory tier: {found} snapshot holder(s) of this run outlived its last driver: "
            + ("restores read them when newer than storage" if continues else "released")
        )
    holders.start(training_nodes())
    if generation is not None:
        fence(holders, generation, check_lease, echo)
    if found and continues:
        retune(holders, generation, echo)
    stop = threading.Event()

    def claim() -> None:
        while not stop.wait(claim_interval(memory.orphan_timeout_s)):
            try:
                holders.claim()
            except Exception as exc:  # the thread's boundary: a cluster going down ends it
                logger.debug("memory tier: claiming the holders failed: %s", exc)

    thread = threading.Thread(target=claim, name="ftjob-holders", daemon=True)
    thread.start()
    try:
        yield holders
    finally:
        stop.set()
        thread.join(timeout=5.0)
        try:
            traffic = run_traffic(holders)
            if traffic.snapshots:
                echo(traffic.line())
            if traffic.refused:
                echo(
                    f"memory tier: the holders refused {traffic.refused} write(s) of an older "
                    "lease generation (a deposed driver's workers)"
                )
            holders.release(generation)
        except Exception as exc:  # the cluster is going down: the holders go with it
            logger.debug("memory tier: releasing the holders failed: %s", exc)


def fence(
    holders: RunHolders,
    generation: int,
    check_lease: Callable[[], None],
    echo: Callable[[str], None],
) -> None:
    """The run's holders fenced by lease ``generation``, before the workers start (see
    :func:`held_snapshots`): what could not be fenced is released; a refusal asks the lease."""
    fenced = holders.fence(generation)
    for node, why in fenced.released.items():
        echo(
            f"memory tier: the holder of node {node[:12]} could not be fenced: {why}: "
            "released, its snapshots are not read"
        )
    if not fenced.refused:
        return
    check_lease()
    left = holders.drop(list(fenced.refused))
    for node, why in fenced.refused.items():
        gone = (
            "still there after 30 s: its ranks' writes are refused, restores read storage"
            if node in left
            else "released, its snapshots are not read"
        )
        echo(
            f"memory tier: the holder of node {node[:12]} refused this driver's fence "
            f"({why}) though the run's lease is this driver's: {gone}"
        )


def retune(holders: RunHolders, generation: int | None, echo: Callable[[str], None]) -> None:
    """The holders that outlived the last driver take this run's ``checkpoint.memory``
    settings (after the fence: none a newer driver holds); what changed, said once."""
    before = holders.configure(generation)
    if not before:
        return
    now = {"max_mb": holders.cap_bytes / 2**20, "keep": holders.keep}
    now["orphan_timeout_s"] = holders.orphan_timeout_s
    changes = [
        f"{key} {' / '.join(sorted({f'{old[key]:g}' for old in before}))} -> {value:g}"
        for key, value in now.items()
        if any(old[key] != value for old in before)
    ]
    echo(
        f"memory tier: {len(before)} snapshot holder(s) that outlived the last driver take this "
        f"run's checkpoint.memory settings ({', '.join(changes)})"
    )


def run_traffic(holders: RunHolders, timeout_s: float = 30.0) -> RunTraffic:
    """What reached the run's live holders: snapshots in place, and bytes through Ray."""
    import ray

    handles = list(holders.held().values())
    asked = [call(h, SnapshotHolder.traffic) for h in handles]
    return RunTraffic.of(ray.get(asked, timeout=timeout_s))


__all__ = [
    "claim_interval",
    "fence",
    "held_snapshots",
    "retune",
    "run_traffic",
    "training_nodes",
]
