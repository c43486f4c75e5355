"""Elastic worker groups on Ray Train (``trainer.min_workers``).

Ray Train's :class:`ElasticScalingPolicy` restarts a failed group on as many workers as the
cluster's nodes can hold (between min and max) and resizes a running group when that number
changes. ftjob runs it with two changes:

- **A dead node is not counted.** Ray learns that a node died from missed health checks
  (about 15 s here) and refreshes its resource view every 20 s; in between, the policy restarts
  the group at full size on the dead node and waits for a placement that never comes. ftjob's
  policy reads a fresh view at each decision and leaves out every node whose raylet does not
  accept a connection -- so after a node loss the group continues at once on the nodes that
  remain.
- **One claim on the cluster per run, not per driver.** Ray Train claims the group's
  resources in Ray's shared autoscaling coordinator under an id of its own run (a new one for
  every driver), renewed every 20 s and dropped at its controller's clean shutdown, or 180 s
  after its last renewal; claims are served oldest first. A driver killed or frozen left its
  claim ahead of the next driver's for up to 3 minutes: that driver saw no capacity to grow
  (a soak's drivers after a SIGKILL ran on 1 of 2 workers throughout). ftjob claims under the
  run's identity: the next driver's claim takes the dead one's place.
- **A planned resize loses no step.** When a running group could grow (a node came back), the
  policy does not tear it down at once: it asks the workers, through the run ledger, to commit
  a checkpoint of their current step (the preemption path: every rank agrees at the next step,
  then waits), and resizes once that checkpoint is recorded (or after ``grow_timeout_s``).

Only a Ray Train-internal hook (the trainer's scaling-policy factory) lets a run choose its
policy; :func:`elastic_policy` swaps it for one ``fit()`` and puts it back.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import ray

from ftjob.actors import Actor, ask, tell
from ftjob.driver.ledger import RunLedger
from ftjob.ray_internals import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
    TrainAutoscalingCoordinatorClient,
    scaling_policy_factory,
    time_monotonic,
)

logger = logging.getLogger(__name__)


def unreachable_nodes(node_ids: set[str], timeout_s: float = 1.0) -> set[str]:
    """Nodes among ``node_ids`` whose raylet refuses a TCP connection (or does not answer in
    ``timeout_s``): dead, even while Ray still lists them as alive."""
    down = set()
    for node in ray.nodes():
        if node["NodeID"] not in node_ids:
            continue
        address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except OSError:
            down.add(node["NodeID"])
    return down


class FtjobElasticPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, counting only reachable nodes, with a just-in-time
    checkpoint before a running group is resized (see the module docstring)."""

    def __init__(
        self,
        scaling_config: Any,
        ledger: Actor[RunLedger],
        requester_id: str,
        grow_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(scaling_config)
        self.ledger = ledger
        self.requester_id = requester_id  # the run's claim in the autoscaling coordinator
        self.grow_timeout_s = grow_timeout_s
        self._pending: tuple[int, float] | None = None  # (target, asked at): its checkpoint
        self._running = False

    def after_controller_start(self, train_run_context: Any) -> None:
        """Ray Train's registration with the autoscaling coordinator, under the run's id (see
        the module docstring) where Ray's is its Ray Train run's."""
        self._requester_id = self.requester_id
        self._coordinator_client = TrainAutoscalingCoordinatorClient(self._requester_id)
        self._send_resource_request()

    def _get_reserved_resources(self) -> Any:
        now = time_monotonic()
        if (
            now - self._latest_reserved_resources_query_time
            < self.GET_RESERVED_RESOURCES_INTERVAL_S
        ):
            return self._latest_reserved_resources
        reserved = None
        try:
            coordinator = self._autoscaling_coordinator
            # recompute: a fresh view of the cluster's nodes, not the last 20 s tick's.
            fresh = ray.get(
                coordinator.get_reserved_resources.remote(self._requester_id, recompute=True),
                timeout=10,
            )
            down = unreachable_nodes(set(fresh))
            if down:
                logger.info("elastic: not counting %d unreachable node(s)", len(down))
            reserved = {node: res for node, res in fresh.items() if node not in down}
        except ray.exceptions.RayError:  # the coordinator or the GCS did not answer
            logger.warning("elastic: could not read the cluster's resources", exc_info=True)
        self._latest_reserved_resources_query_time = time_monotonic()
        self._latest_reserved_resources = reserved
        return reserved

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        if self._running:  # the group just failed: a view from before is not good enough
            self._latest_reserved_resources_query_time = float("-inf")
            self._running = False
        self._pending = None  # an ordinary restart, whatever was planned
        return super().make_decision_for_non_running_worker_group()

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> ScalingDecision:
        self._running = True
        current = worker_group_state.num_workers
        if self._pending is not None:
            return self._resize_when_checkpointed(current)
        decision = super().make_decision_for_running_worker_group(
            worker_group_state, worker_group_status
        )
        if not isinstance(decision, ResizeDecision) or decision.num_workers < current:
            # Fewer placeable workers while the group runs: a node is dying under it, and the
            # failure it is about to cause restarts the group on what is left.
            return NoopDecision()
        tell(self.ledger, RunLedger.request_resize, current, decision.num_workers, time.time())
        self._pending = (decision.num_workers, time_monotonic())
        return NoopDecision()

    def _resize_when_checkpointed(self, current: int) -> ScalingDecision:
        assert self._pending is not None
        target, asked = self._pending
        try:
            done = ask(self.ledger, RunLedger.resize_checkpointed, 10)
        except ray.exceptions.RayError as exc:  # asked again at the next poll
            logger.warning("elastic: the run ledger did not answer: %s", exc)
            done = False
        if not done and time_monotonic() - asked < self.grow_timeout_s:
            # Again: a request made before this group's first step is cleared by its start.
            tell(self.ledger, RunLedger.request_resize, current, target, time.time())
            return NoopDecision()
        if not done:
            logger.warning(
                "elastic: no checkpoint before the resize after %.0f s: resizing anyway",
                self.grow_timeout_s,
            )
        self._pending = None
        # The workers wait to be torn down now: restart them, at what can be placed now (the
        # capacity may have gone again meanwhile; the same size still restarts the group).
        reserved = self._get_reserved_resources()
        placeable = self._count_possible_workers(reserved) if reserved is not None else target
        tell(self.ledger, RunLedger.resize_executed, time.time())
        return self._get_resize_decision(max(self.scaling_config.min_workers, placeable))


@contextlib.contextmanager
def elastic_policy(
    ledger: Actor[RunLedger], requester_id: str, grow_timeout_s: float = 120.0
) -> Iterator[None]:
    """While active, an elastic TorchTrainer.fit() runs :class:`FtjobElasticPolicy`, its
    claim on the cluster under ``requester_id`` (one per run: its identity)."""

    def create(scaling_config: Any, ray_factory: Any) -> Any:
        if scaling_config.elasticity_enabled:
            return FtjobElasticPolicy(scaling_config, ledger, requester_id, grow_timeout_s)
        return ray_factory(scaling_config)

    with scaling_policy_factory(create):
        yield
