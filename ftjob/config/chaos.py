"""``chaos.*``: the faults a run injects into itself -- kills, preemptions, hangs, slow ranks --
and faults of its checkpoint storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ftjob.config.choices import Choice, coerce_choices
from ftjob.config.rules import require


class ChaosKind(Choice):
    """``chaos.kind``: what each kill of the schedule does."""

    none = "none"
    node = "node"  # a node's raylet is killed, and every worker on it
    worker = "worker"  # one training worker is killed
    preempt = "preempt"  # a node is drained with notice, then killed at the deadline
    hang = "hang"  # one training worker stops making progress
    slow = "slow"  # one training worker sleeps part of every step
    mixed = "mixed"  # the kinds of chaos.mix in turn: kill k is mix[k % len(mix)]


class ChaosTarget(Choice):
    """``chaos.target``: which rank, or whose node, a kill hits."""

    any = "any"  # chosen at random (chaos.seed)
    rank0 = "rank0"  # rank 0, or rank 0's node: the rank that writes checkpoints


NODE_KINDS = (ChaosKind.node, ChaosKind.preempt)  # chaos that takes a whole node away
WORKER_KINDS = (ChaosKind.worker, ChaosKind.hang, ChaosKind.slow)  # hits one training worker
# The next window waits for a restart.
ENDS_ATTEMPT = (ChaosKind.node, ChaosKind.preempt, ChaosKind.worker, ChaosKind.hang)
# What chaos.mix may hold: every kind that strikes (a mix of mixes means nothing).
MIXABLE = (ChaosKind.worker, ChaosKind.node, ChaosKind.preempt, ChaosKind.hang, ChaosKind.slow)

# The storage faults chaos.storage injects. ``chaos.storage.errors`` is a list, and OmegaConf
# names a list's element (``chaos.storage.errors[0]``), not the key a user set, when it refuses
# one: the list stays plain strings, checked here.
STORAGE_ERRORS = ("throttle", "reset", "timeout", "permanent")


@dataclass
class StorageChaosConfig:
    _group: ClassVar[str] = "chaos.storage"
    failure_rate: float = 0.0
    errors: list[str] = field(default_factory=lambda: ["throttle", "reset", "timeout"])
    upload_delay: float = 0.0

    def __post_init__(self) -> None:
        g = self._group
        require(
            self.upload_delay >= 0,
            g,
            "upload_delay",
            self.upload_delay,
            "must be >= 0 seconds (added to every checkpoint upload request)",
        )
        require(
            0 <= self.failure_rate < 1,
            g,
            "failure_rate",
            self.failure_rate,
            "must be a fraction in [0, 1)",
        )
        bad = [e for e in self.errors if e not in STORAGE_ERRORS]
        require(not bad, g, "errors", self.errors, f"each must be one of {list(STORAGE_ERRORS)}")
        require(bool(self.errors), g, "errors", self.errors, "must name at least one error kind")


@dataclass
class ChaosConfig:
    _group: ClassVar[str] = "chaos"
    kind: ChaosKind = ChaosKind.none
    target: ChaosTarget = ChaosTarget.any
    interval: float = 480.0
    max_kills: int = 0
    start_delay: float = 0.0
    jitter: bool = True
    seed: int = 0
    fail_at_steps: list[int] = field(default_factory=list)
    at_steps: list[int] = field(default_factory=list)
    notice: float = 30.0
    slowdown: float = 0.5
    # chaos.kind=mixed: the kinds its kills take in turn. A list, so OmegaConf would name an
    # element (chaos.mix[0]) when refusing one: plain strings, checked here.
    mix: list[str] = field(default_factory=lambda: [k.value for k in MIXABLE])
    # node and preempt kills take a raylet down with every tenant's work on it: on a cluster
    # ftjob did not start (ray.address) they need this explicit opt-in.
    allow_on_existing_cluster: bool = False
    storage: StorageChaosConfig = field(default_factory=StorageChaosConfig)

    def __post_init__(self) -> None:
        coerce_choices(self)
        g = self._group
        require(self.interval > 0, g, "interval", self.interval, "must be > 0 seconds")
        require(self.max_kills >= 0, g, "max_kills", self.max_kills, "must be >= 0")
        require(self.notice > 0, g, "notice", self.notice, "must be > 0 seconds of notice")
        require(
            self.slowdown > 0,
            g,
            "slowdown",
            self.slowdown,
            "must be > 0 (the fraction of its own step time a slow rank sleeps in each step)",
        )
        require(self.start_delay >= 0, g, "start_delay", self.start_delay, "must be >= 0 seconds")
        require(
            all(s > 0 for s in self.fail_at_steps),
            g,
            "fail_at_steps",
            self.fail_at_steps,
            "steps are 1-based: each must be >= 1",
        )
        require(
            all(s > 0 for s in self.at_steps),
            g,
            "at_steps",
            self.at_steps,
            "steps are 1-based: each must be >= 1",
        )
        mixable = [k.value for k in MIXABLE]
        require(
            bool(self.mix) and all(k in mixable for k in self.mix),
            g,
            "mix",
            self.mix,
            f"must list one or more of {mixable} (chaos.kind=mixed takes them in turn)",
        )
        require(
            not self.at_steps or self.kind != ChaosKind.none,
            g,
            "at_steps",
            self.at_steps,
            "kills at steps need a kind: set chaos=node_killer or chaos=worker_killer",
        )

    def kinds(self) -> list[ChaosKind]:
        """The kinds this run's kills take: ``chaos.mix`` in turn for ``mixed``, else the one
        ``chaos.kind``."""
        return [ChaosKind(k) for k in self.mix] if self.kind == ChaosKind.mixed else [self.kind]

    def takes_nodes(self) -> bool:
        """Does any kill of this run take a whole node away?"""
        return self.enabled and any(k in NODE_KINDS for k in self.kinds())

    @property
    def enabled(self) -> bool:
        """Does the run have a kill schedule at all?"""
        return self.kind != ChaosKind.none and (self.max_kills > 0 or bool(self.at_steps))
