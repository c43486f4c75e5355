"""``failure.*``: Ray Train's failure budget, preemption notices, hangs, stragglers and restart
loops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ftjob.config.choices import Choice, coerce_choices
from ftjob.config.legacy import move_renamed_failure_keys
from ftjob.config.rules import at_least, refuse_non_finite, require


@dataclass
class HangConfig:
    """Hangs (``failure.hang``): every rank sends the run ledger a heartbeat (its section and
    when it last made progress); a rank that makes no progress for longer than its section's
    timeout, while the whole group is quiet, is a hang -- its stack is captured (py-spy) and
    the group restarted from the last checkpoint, spending one failure of
    ``failure.max_failures``. See :mod:`ftjob.policy.hang`."""

    _group: ClassVar[str] = "failure.hang"
    enabled: bool = True
    """Detect hangs at all."""
    timeout: float | None = None
    """Seconds without progress in any section; null = learned per section from the run."""
    min_timeout: float = 20.0
    """Learned timeouts are at least this many seconds (a stopped process is found at this)."""
    max_timeout: float = 600.0
    """Learned timeouts are at most this; also the timeout of a section not yet learned."""
    safety_factor: float = 5.0
    """Tuning: a learned timeout is this x the section's observed 99th percentile."""
    warmup: int = 3
    """Tuning: observations of a section before its timeout is learned."""
    settle_steps: int = 10
    """Tuning: the first steps of every attempt (start-up: the first decode window, allocator
    and kernel warm-up) are progress but not learned from -- step timeouts come from steady
    state, so a slow start does not stretch them."""
    heartbeat_interval: float = 1.0
    """Tuning: seconds between a rank's heartbeats."""

    def __post_init__(self) -> None:
        refuse_non_finite(self, f"{self._group}.")  # before rules that compare keys
        g = self._group
        for key in ("heartbeat_interval", "min_timeout", "max_timeout"):
            require(getattr(self, key) > 0, g, key, getattr(self, key), "must be > 0 seconds")
        at_least(self, "warmup", 1)
        at_least(self, "settle_steps", 0)
        at_least(self, "safety_factor", 1, " (timeouts: this x the observed 99th percentile)")
        at_least(self, "max_timeout", self.min_timeout, " (failure.hang.min_timeout)")
        require(
            self.timeout is None or self.timeout > 0,
            g,
            "timeout",
            self.timeout,
            "must be > 0 seconds, or null to learn each section's timeout from the run",
        )


class StragglerAction(Choice):
    """``failure.straggler.action``: what a persistent straggler leads to."""

    none = "none"  # it is named in the progress output and summary.json
    restart = "restart"  # it also ends the attempt, like a failed worker


@dataclass
class StragglerConfig:
    """Stragglers (``failure.straggler``): a rank whose local step time (batch wait and compute,
    not waiting for others) is at least ``threshold`` x the fastest rank's, for ``patience``
    checks (about seconds) in a row, is named in the progress output and summary.json."""

    _group: ClassVar[str] = "failure.straggler"
    threshold: float = 1.3
    """The slowdown against the fastest rank that counts as straggling."""
    patience: int = 10
    """Checks in a row at or above the threshold before a rank is a straggler."""
    action: StragglerAction = StragglerAction.none
    """none | restart (a persistent straggler ends the attempt like a failed worker)."""

    def __post_init__(self) -> None:
        coerce_choices(self)
        at_least(self, "patience", 1)
        require(
            self.threshold > 1,
            self._group,
            "threshold",
            self.threshold,
            "must be > 1 (a slowdown against the fastest rank, e.g. 1.3)",
        )


@dataclass
class RestartLoopConfig:
    """Restart loops (``failure.restart_loop``): stop, instead of spending the whole failure
    budget, when ``attempts`` attempts in a row failed before training ``min_steps`` steps past
    the furthest step the run reached."""

    _group: ClassVar[str] = "failure.restart_loop"
    attempts: int = 3
    """Attempts in a row without progress that stop the run; 0 = no guard."""
    min_steps: int = 1
    """Steps past the furthest step reached that count as progress."""

    def __post_init__(self) -> None:
        at_least(self, "attempts", 0, " (0 = no restart-loop guard)")
        at_least(self, "min_steps", 1)


@dataclass
class FailureConfig:
    """Failures: Ray Train's budget, preemption notices, hangs, stragglers, restart loops."""

    _group: ClassVar[str] = "failure"
    max_failures: int = 3
    """Worker-group failures to recover from; -1 = unlimited."""
    preemption: bool = True
    """A preemption notice (a node drain, SIGTERM to the driver or a worker) commits a
    just-in-time checkpoint of the current step: 0 lost steps."""
    max_preemptions: int = -1
    """Preemptions to recover from, counted apart from max_failures; -1 = unlimited."""
    expected_mtbf_s: float | None = None
    """Seconds between failures you expect: trainer.checkpoint_every_n_steps=auto checkpoints at
    the interval that wastes least for it; the summary's predicted ETTR uses it."""
    hang: HangConfig = field(default_factory=HangConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    restart_loop: RestartLoopConfig = field(default_factory=RestartLoopConfig)
    health_check_interval: float = 0.5
    """Tuning: seconds between Ray Train's polls of its workers -- how soon a failure is
    noticed and a report taken (Ray's default: 2.0)."""
    preemption_poll_interval: float = 1.0
    """Tuning: seconds between polls of node drains (Ray Train's own watcher: 5.0)."""
    preemption_grace_s: float = 0.0
    """Tuning: Ray Train keeps surviving workers this long past a preemption deadline."""
    relax_collectives_on_preemption: bool = False
    """Tuning: Ray Train's report and preemption barriers may complete without preempted ranks."""
    # The keys of ftjob.config.legacy.RENAMED_FAILURE_KEYS, as earlier versions spelled them
    # (null: not given).
    hang_detection: bool | None = None
    hang_timeout: float | None = None
    hang_safety_factor: float | None = None
    hang_min_timeout: float | None = None
    hang_max_timeout: float | None = None
    hang_warmup: int | None = None
    heartbeat_interval: float | None = None
    straggler_threshold: float | None = None
    straggler_patience: int | None = None
    straggler_action: StragglerAction | None = None
    restart_loop_attempts: int | None = None
    restart_loop_min_steps: int | None = None

    def __post_init__(self) -> None:
        move_renamed_failure_keys(self)
        g = self._group
        for key in ("max_failures", "max_preemptions"):
            value = getattr(self, key)
            require(value >= -1, g, key, value, "must be >= 0, or -1 for unlimited")
        for key in ("preemption_poll_interval", "health_check_interval"):
            require(getattr(self, key) > 0, g, key, getattr(self, key), "must be > 0 seconds")
        at_least(self, "preemption_grace_s", 0, " seconds")
        require(
            self.expected_mtbf_s is None or self.expected_mtbf_s > 0,
            g,
            "expected_mtbf_s",
            self.expected_mtbf_s,
            "must be > 0 seconds (the mean time between failures you expect), or null",
        )
