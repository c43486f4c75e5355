"""``ray.*``: the Ray cluster the job runs on -- one ftjob starts (embedded, or simulated with
several local nodes) or an existing one at ``ray.address``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftjob.config.rules import at_least, require


@dataclass
class RayConfig:
    _group: ClassVar[str] = "ray"
    address: str | None = None
    local_nodes: int = 1
    num_cpus: int | None = None
    node_cpus: int = 2
    replace_delay: float = 5.0
    replace_nodes: bool = True  # simulated cluster: killed nodes come back after replace_delay
    # Simulated cluster: and not before the group that went on without the node trained this
    # many steps (a return tied to the run's progress, not to the machine's speed).
    replace_after_steps: int | None = None
    log_to_driver: bool = False
    # A cluster ftjob starts on this machine may run more training workers (or their CPUs)
    # than the machine has cores: refused unless this says so.
    oversubscribe: bool = False
    runtime_env: dict[str, Any] = field(default_factory=dict)
    # Existing cluster: seconds to wait for nodes the job needs (an autoscaler may add them).
    resources_timeout: float = 600.0
    # Clusters ftjob starts: how long Ray waits on an object pull before asking another copy.
    object_pull_timeout_ms: int | None = 1000
    # Clusters ftjob starts: how soon Ray marks a dead node dead (period x failures).
    health_check_period_ms: int | None = 1000
    health_check_failure_threshold: int | None = 3

    def __post_init__(self) -> None:
        g = self._group
        require(
            self.health_check_period_ms is None or self.health_check_period_ms >= 100,
            g,
            "health_check_period_ms",
            self.health_check_period_ms,
            "must be >= 100 ms, or null for Ray's default (3000)",
        )
        require(
            self.health_check_failure_threshold is None or self.health_check_failure_threshold >= 1,
            g,
            "health_check_failure_threshold",
            self.health_check_failure_threshold,
            "must be >= 1, or null for Ray's default (5)",
        )
        require(
            self.object_pull_timeout_ms is None or self.object_pull_timeout_ms >= 100,
            g,
            "object_pull_timeout_ms",
            self.object_pull_timeout_ms,
            "must be >= 100 ms, or null for Ray's default (10000)",
        )
        require(
            self.local_nodes >= 1,
            g,
            "local_nodes",
            self.local_nodes,
            "must be >= 1 (1 = one local node)",
        )
        require(
            self.num_cpus is None or self.num_cpus >= 1,
            g,
            "num_cpus",
            self.num_cpus,
            "must be >= 1 or null",
        )
        require(self.node_cpus >= 1, g, "node_cpus", self.node_cpus, "must be >= 1")
        at_least(self, "resources_timeout", 0, " seconds (0 = refuse at once what does not fit)")
        require(
            self.replace_delay >= 0, g, "replace_delay", self.replace_delay, "must be >= 0 seconds"
        )
        require(
            self.replace_after_steps is None or self.replace_after_steps >= 1,
            g,
            "replace_after_steps",
            self.replace_after_steps,
            "must be >= 1 step, or null to replace a killed node after replace_delay seconds alone",
        )
        require(
            self.address is None or self.local_nodes == 1,
            g,
            "local_nodes",
            self.local_nodes,
            "a simulated cluster (local_nodes > 1) cannot be combined with ray.address",
        )
