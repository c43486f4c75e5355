"""Node drains (preemption notices from Ray Core) relayed to the training workers.

Ray Train watches drains with a PreemptionWatcher actor that it starts -- a new process -- with
every worker group, and kills with it: on a 2-core machine, measured at 1.5 CPU-seconds per
attempt, taken from the new workers while they set up (a worker kill's set-up 3.4 s with it, 2.4
s without). ftjob turns Ray Train's watcher off (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``) and
does the same work in the run ledger's process, which lives for the whole run: a
:class:`DrainRelay` there polls Ray Core's draining nodes and, when a node of the current worker
group starts draining, marks every worker preempted exactly as Ray Train's watcher does
(``mark_preempt`` with a ``PreemptionInfo``). Everything downstream is Ray Train's own: the
workers' preemption context (read by :mod:`ftjob.worker.preemption`), the controller's preempting state
and its preemption budget. The failure domain is the node (Ray Train also widens a drained TPU
host to its slice; ftjob's GPU and CPU jobs have none).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ftjob.actors import Actor, tell
from ftjob.ray_internals import draining_nodes

logger = logging.getLogger("ftjob.driver.drains")


class DrainRelay:
    """Polls for drains of the current worker group's nodes; marks its workers preempted."""

    def __init__(
        self, interval_s: float, drains: Callable[[], dict[str, int]] = draining_nodes
    ) -> None:
        self.interval, self._drains = interval_s, drains
        self._lock = threading.Lock()
        self._nodes: dict[str, list[int]] = {}  # node id -> the group's ranks on it
        self._actors: dict[int, Any] = {}  # rank -> its Ray Train worker actor
        self._last: dict[str, int] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, node_to_ranks: dict[str, list[int]], actors: dict[int, Any]) -> None:
        """A new worker group (or none: ``{}``, after its shutdown); polled at once."""
        with self._lock:
            self._nodes = {node: sorted(ranks) for node, ranks in node_to_ranks.items()}
            self._actors, self._last = dict(actors), {}
        self._wake.set()

    def start(self) -> None:
        """Poll on a thread from now on (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftjob-drains", daemon=True)
            self._thread.start()

    def poll_once(self) -> Any:
        """Marks the workers when the set of drained nodes of the group changed to a non-empty
        one; returns the ``PreemptionInfo`` sent, else None."""
        with self._lock:
            nodes, actors, last = self._nodes, self._actors, self._last
        if not nodes:
            return None
        drained = {node: d for node, d in self._drains().items() if node in nodes}
        with self._lock:
            if drained == last or self._nodes is not nodes:  # no change, or a new group meanwhile
                return None
            self._last = drained
        if not drained:
            return None
        from ray.train.v2.api.preemption import PreemptionInfo

        deadlines = [d for d in drained.values() if d]  # 0: the drain announced no deadline
        info = PreemptionInfo(
            deadline_ms=min(deadlines) if deadlines else None,
            preempted_node_to_ranks={node: nodes[node] for node in sorted(drained)},
        )
        for actor in actors.values():
            actor.mark_preempt.remote(info)
        return info

    def _run(self) -> None:
        import ray

        # Ray Train's preemption types import Ray Data (0.6 CPU-seconds): once, here, not when
        # the first drain must be relayed in a hurry.
        import ray.train.v2.api.preemption  # noqa: F401

        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.poll_once()
            except (ray.exceptions.RayError, ConnectionError, TimeoutError):  # a GCS hiccup
                logger.warning("polling Ray for node drains failed; polling on", exc_info=True)


class DrainWatch(Protocol):
    """The run ledger's method the relay's hooks call (the ledger runs the relay)."""

    def watch_drains(
        self, interval: float, nodes: dict[str, list[int]], actors: dict[int, Any]
    ) -> None: ...


class _RelayHooks:
    """Tells the run ledger's :class:`DrainRelay` which workers run where, per worker group."""

    def __init__(self, ledger: Actor[DrainWatch], interval_s: float) -> None:
        self.ledger, self.interval = ledger, interval_s

    def after_worker_group_start(self, worker_group: Any) -> None:
        nodes: dict[str, list[int]] = {}
        actors: dict[int, Any] = {}
        for w in worker_group.get_workers():
            rank = w.distributed_context.world_rank
            nodes.setdefault(w.metadata.node_id, []).append(rank)
            actors[rank] = w.actor
        tell(self.ledger, DrainWatch.watch_drains, self.interval, nodes, actors)

    def before_worker_group_shutdown(self, worker_group: Any) -> None:
        tell(self.ledger, DrainWatch.watch_drains, self.interval, {}, {})

    def after_worker_group_abort(self, worker_group_context: Any) -> None:
        tell(self.ledger, DrainWatch.watch_drains, self.interval, {}, {})


def drain_relay(ledger: Actor[DrainWatch], interval_s: float) -> Any:
    """The Ray Train callback that replaces its per-attempt PreemptionWatcher (with
    ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``)."""
    from ftjob.ray_internals import WorkerGroupCallback

    cls = type("DrainRelayCallback", (_RelayHooks, WorkerGroupCallback), {})
    return cls(ledger, interval_s)
