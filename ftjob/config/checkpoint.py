"""``checkpoint.*``: where checkpoints go, how uploads retry, and the memory tier."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftjob.config.choices import Choice, coerce_choices
from ftjob.config.rules import ConfigError, at_least, refuse_non_finite, require


@dataclass
class RetryConfig:
    """How storage requests are retried (see ftjob.storage.retry.RetryPolicy)."""

    _group: ClassVar[str] = "checkpoint.retry"
    max_attempts: int = 5
    initial_backoff: float = 0.5
    multiplier: float = 2.0
    max_backoff: float = 20.0
    jitter: float = 0.25
    deadline: float | None = 300.0
    retry_on: list[str] = field(default_factory=list)
    give_up_on: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        refuse_non_finite(self, f"{self._group}.")  # before rules that compare keys
        g = self._group
        require(
            self.max_attempts >= 1,
            g,
            "max_attempts",
            self.max_attempts,
            "must be >= 1 (1 = no retries)",
        )
        require(
            self.initial_backoff >= 0,
            g,
            "initial_backoff",
            self.initial_backoff,
            "must be >= 0 seconds",
        )
        require(self.multiplier >= 1, g, "multiplier", self.multiplier, "must be >= 1")
        require(
            self.max_backoff >= self.initial_backoff,
            g,
            "max_backoff",
            self.max_backoff,
            f"must be >= initial_backoff ({self.initial_backoff})",
        )
        require(0 <= self.jitter <= 1, g, "jitter", self.jitter, "must be a fraction in [0, 1]")
        require(
            self.deadline is None or self.deadline > 0,
            g,
            "deadline",
            self.deadline,
            "must be > 0 seconds, or null for no deadline",
        )
        check_error_rules(self.retry_on, f"{g}.retry_on")
        check_error_rules(self.give_up_on, f"{g}.give_up_on")


def check_error_rules(rules: list[str] | tuple[str, ...], key: str) -> None:
    """Each rule is an exception type name or a regex of the message: a bad regex is refused
    at startup (and by ``python -m ftjob.check``), not at the first storage error."""
    for rule in rules:
        try:
            re.compile(rule)
        except re.error as exc:
            raise ConfigError(
                key, list(rules), f"{rule!r} is neither an exception type name nor a regex ({exc})"
            ) from None


@dataclass
class MemoryConfig:
    """The memory tier (``checkpoint.memory``): snapshots of the training state held in memory
    by a process on every node that runs training ranks, outliving the workers (and, where the
    cluster lives on, the driver), restored after a failure, preemption or resize when newer
    than the newest durable checkpoint. Durable checkpoints are unchanged; a run's final
    checkpoint is always durable. See :mod:`ftjob.memory`."""

    _group: ClassVar[str] = "checkpoint.memory"
    enabled: bool = False
    """Take snapshots and restore from them."""
    # Steps, or "auto". OmegaConf 2.3 types no union of int and a word, so this key is checked
    # here.
    every_n_steps: Any = 1
    """A snapshot every this many steps: about what a failure loses (one more while a
    snapshot is still being sent: a due one is skipped, never waited for). ``auto``: the
    shortest interval whose measured snapshot cost stays under ``max_overhead`` of step time
    (:class:`ftjob.policy.cadence.SnapshotCadence`)."""
    keep: int = 2
    """Snapshots held; older ones are dropped."""
    max_mb: float = 2048.0
    """Memory the held snapshots may take; a state bigger than this turns the tier off for
    the run, with one line. On the holder's machine its ring takes ``keep + 1`` slots of about
    the state's size up front; where they do not fit, snapshots are sent through Ray."""
    orphan_timeout_s: float = 300.0
    """How long a node's holder outlives a driver that stopped claiming it (a driver killed
    with the cluster kept): the next driver of the run restores from it within this time;
    after it the holder releases its memory. A run that ends releases its holders at once."""
    max_overhead: float = 0.02
    """With ``every_n_steps=auto``: the fraction of step time snapshots may cost (what they take
    from the training thread; on a CPU worker their background thread's CPU too)."""

    def __post_init__(self) -> None:
        every = self.every_n_steps
        require(
            every == "auto" or (type(every) is int and every >= 1),
            self._group,
            "every_n_steps",
            every,
            "must be a number of steps >= 1, or auto (the shortest interval whose measured "
            "snapshot cost stays under checkpoint.memory.max_overhead of step time)",
        )
        require(
            0 < self.max_overhead < 1,
            self._group,
            "max_overhead",
            self.max_overhead,
            "must be a fraction of step time in (0, 1), e.g. 0.02",
        )
        at_least(self, "keep", 1)
        require(self.max_mb > 0, self._group, "max_mb", self.max_mb, "must be > 0 MB")
        require(
            self.orphan_timeout_s > 0,
            self._group,
            "orphan_timeout_s",
            self.orphan_timeout_s,
            "must be > 0 seconds (how long held snapshots wait for the run's next driver)",
        )


class UploadMode(Choice):
    """``checkpoint.upload_mode``: ``sync`` (the step waits for the upload) or ``async`` (a
    background thread uploads while training goes on)."""

    sync = "sync"
    # A member is named as its word, and ``async`` is a keyword: set in the class's namespace
    # (an enum's body is that namespace) rather than spelled as a name.
    locals()["async"] = "async"


@dataclass
class CheckpointConfig:
    _group: ClassVar[str] = "checkpoint"
    storage_path: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    num_to_keep: int = 2
    upload_mode: UploadMode = UploadMode.sync
    max_consecutive_upload_failures: int = 0
    shared_filesystem: bool = False
    restart_if_unrecoverable: bool = False
    lease_timeout: float = 60.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        coerce_choices(self)
        g = self._group
        require(self.num_to_keep >= 1, g, "num_to_keep", self.num_to_keep, "must be >= 1")
        require(
            self.lease_timeout >= 5,
            g,
            "lease_timeout",
            self.lease_timeout,
            "must be >= 5 seconds (the driver renews its lease every quarter of it)",
        )
        require(
            self.max_consecutive_upload_failures >= 0,
            g,
            "max_consecutive_upload_failures",
            self.max_consecutive_upload_failures,
            "must be >= 0 (0 = the first upload that fails after all retries fails the job)",
        )
        require(
            self.storage_path is None or self.storage_path.strip() != "",
            g,
            "storage_path",
            self.storage_path,
            "must be an fsspec URL or path, or null for <run dir>/checkpoints",
        )
