"""The job schema: one typed dataclass per config group, validated once before Ray starts.

Hydra composes conf/ against these dataclasses (registered in the ConfigStore as
``ftjob_schema``), so an unknown key or a wrong type is refused at composition. Value rules
live in each dataclass's ``__post_init__`` and raise :class:`ConfigError`, whose message names
the full key, the value and the rule. ``model`` and ``dataset`` are ``_target_`` groups: their
keys are checked against the target's signature by :func:`check_target`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

# Keys whose missing value deserves more than "set it": what a user actually types.
_MISSING_HINTS = {
    "dataset.path": "set dataset.path=/data/imagenet (or s3://bucket/imagenet): a folder with "
    "train/ and val/ class subfolders",
    "name": "set name=RUN_NAME",
    "checkpoint.storage_path": "set checkpoint.storage_path=s3://bucket/prefix (or gs://..., or a "
    "path every node mounts, with checkpoint.shared_filesystem=true)",
}


class ConfigError(ValueError):
    """A config value breaks a rule. ``str()`` is one line: key, value, rule. ``supply``: the
    value is one the user must give at run time (``python -m ftjob.check`` reports it as
    "needs", not as an error of the config file)."""

    def __init__(self, key: str, value: Any, rule: str, supply: bool = False) -> None:
        self.key, self.value, self.rule, self.supply = key, value, rule, supply
        super().__init__(f"{key}={value!r}: {rule}")


class JobError(RuntimeError):
    """The job cannot run as configured (on this cluster, with this data); the message says
    what to change."""


def _require(ok: bool, group: str, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{group}.{key}" if group else key, value, rule)


def _at_least(config: Any, key: str, minimum: float, note: str = "") -> None:
    value = getattr(config, key)
    _require(value >= minimum, config._group, key, value, f"must be >= {minimum:g}{note}")


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
        _require(
            self.max_attempts >= 1,
            g,
            "max_attempts",
            self.max_attempts,
            "must be >= 1 (1 = no retries)",
        )
        _require(
            self.initial_backoff >= 0,
            g,
            "initial_backoff",
            self.initial_backoff,
            "must be >= 0 seconds",
        )
        _require(self.multiplier >= 1, g, "multiplier", self.multiplier, "must be >= 1")
        _require(
            self.max_backoff >= self.initial_backoff,
            g,
            "max_backoff",
            self.max_backoff,
            f"must be >= initial_backoff ({self.initial_backoff})",
        )
        _require(0 <= self.jitter <= 1, g, "jitter", self.jitter, "must be a fraction in [0, 1]")
        _require(
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


UPLOAD_MODES = ("sync", "async")


@dataclass
class MemoryConfig:
    """The memory tier (``checkpoint.memory``): snapshots of the training state held in memory
    by a process that outlives the workers (on the driver's node), restored after a failure,
    preemption or resize when newer than the newest durable checkpoint. Durable checkpoints are
    unchanged; a run's final checkpoint is always durable. See :mod:`ftjob.storage.memory`."""

    _group: ClassVar[str] = "checkpoint.memory"
    enabled: bool = False
    """Take snapshots and restore from them."""
    every_n_steps: int = 1
    """A snapshot every this many steps: about what a failure loses (one more while a
    snapshot is still being sent: a due one is skipped, never waited for)."""
    keep: int = 2
    """Snapshots held; older ones are dropped."""
    max_mb: float = 2048.0
    """Memory the held snapshots may take; a state bigger than this turns the tier off for
    the run, with one line. On the holder's machine its ring takes ``keep + 1`` slots of about
    the state's size up front; where they do not fit, snapshots are sent through Ray."""

    def __post_init__(self) -> None:
        _at_least(self, "every_n_steps", 1)
        _at_least(self, "keep", 1)
        _require(self.max_mb > 0, self._group, "max_mb", self.max_mb, "must be > 0 MB")


@dataclass
class CheckpointConfig:
    _group: ClassVar[str] = "checkpoint"
    storage_path: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    num_to_keep: int = 2
    upload_mode: str = "sync"
    max_consecutive_upload_failures: int = 0
    shared_filesystem: bool = False
    restart_if_unrecoverable: bool = False
    lease_timeout: float = 60.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        g = self._group
        _require(self.num_to_keep >= 1, g, "num_to_keep", self.num_to_keep, "must be >= 1")
        _require(
            self.lease_timeout >= 5,
            g,
            "lease_timeout",
            self.lease_timeout,
            "must be >= 5 seconds (the driver renews its lease every quarter of it)",
        )
        _require(
            self.upload_mode in UPLOAD_MODES,
            g,
            "upload_mode",
            self.upload_mode,
            f"must be one of {list(UPLOAD_MODES)}",
        )
        _require(
            self.max_consecutive_upload_failures >= 0,
            g,
            "max_consecutive_upload_failures",
            self.max_consecutive_upload_failures,
            "must be >= 0 (0 = the first upload that fails after all retries fails the job)",
        )
        _require(
            self.storage_path is None or self.storage_path.strip() != "",
            g,
            "storage_path",
            self.storage_path,
            "must be an fsspec URL or path, or null for <run dir>/checkpoints",
        )


CHAOS_KINDS = ("none", "node", "worker", "preempt", "hang", "slow")
NODE_KINDS = ("node", "preempt")  # chaos that takes a whole node away
WORKER_KINDS = ("worker", "hang", "slow")  # chaos that hits one training worker
ENDS_ATTEMPT = ("node", "preempt", "worker", "hang")  # the next window waits for a restart
LR_SCHEDULES = ("constant", "cosine")
STORAGE_ERRORS = ("throttle", "reset", "timeout", "permanent")


@dataclass
class StorageChaosConfig:
    _group: ClassVar[str] = "chaos.storage"
    failure_rate: float = 0.0
    errors: list[str] = field(default_factory=lambda: ["throttle", "reset", "timeout"])
    upload_delay: float = 0.0

    def __post_init__(self) -> None:
        g = self._group
        _require(
            self.upload_delay >= 0,
            g,
            "upload_delay",
            self.upload_delay,
            "must be >= 0 seconds (added to every checkpoint upload request)",
        )
        _require(
            0 <= self.failure_rate < 1,
            g,
            "failure_rate",
            self.failure_rate,
            "must be a fraction in [0, 1)",
        )
        bad = [e for e in self.errors if e not in STORAGE_ERRORS]
        _require(not bad, g, "errors", self.errors, f"each must be one of {list(STORAGE_ERRORS)}")
        _require(bool(self.errors), g, "errors", self.errors, "must name at least one error kind")


@dataclass
class ChaosConfig:
    _group: ClassVar[str] = "chaos"
    kind: str = "none"
    interval: float = 480.0
    max_kills: int = 0
    start_delay: float = 0.0
    jitter: bool = True
    seed: int = 0
    fail_at_steps: list[int] = field(default_factory=list)
    at_steps: list[int] = field(default_factory=list)
    notice: float = 30.0
    slowdown: float = 0.5
    # node and preempt kills take a raylet down with every tenant's work on it: on a cluster
    # ftjob did not start (ray.address) they need this explicit opt-in.
    allow_on_existing_cluster: bool = False
    storage: StorageChaosConfig = field(default_factory=StorageChaosConfig)

    def __post_init__(self) -> None:
        g = self._group
        _require(
            self.kind in CHAOS_KINDS, g, "kind", self.kind, f"must be one of {list(CHAOS_KINDS)}"
        )
        _require(self.interval > 0, g, "interval", self.interval, "must be > 0 seconds")
        _require(self.max_kills >= 0, g, "max_kills", self.max_kills, "must be >= 0")
        _require(self.notice > 0, g, "notice", self.notice, "must be > 0 seconds of notice")
        _require(
            self.slowdown > 0,
            g,
            "slowdown",
            self.slowdown,
            "must be > 0 (the fraction of its own step time a slow rank sleeps in each step)",
        )
        _require(self.start_delay >= 0, g, "start_delay", self.start_delay, "must be >= 0 seconds")
        _require(
            all(s > 0 for s in self.fail_at_steps),
            g,
            "fail_at_steps",
            self.fail_at_steps,
            "steps are 1-based: each must be >= 1",
        )
        _require(
            all(s > 0 for s in self.at_steps),
            g,
            "at_steps",
            self.at_steps,
            "steps are 1-based: each must be >= 1",
        )
        _require(
            not self.at_steps or self.kind != "none",
            g,
            "at_steps",
            self.at_steps,
            "kills at steps need a kind: set chaos=node_killer or chaos=worker_killer",
        )

    @property
    def enabled(self) -> bool:
        """Does the run have a kill schedule at all?"""
        return self.kind != "none" and (self.max_kills > 0 or bool(self.at_steps))


STRAGGLER_ACTIONS = ("none", "restart")


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
            _require(getattr(self, key) > 0, g, key, getattr(self, key), "must be > 0 seconds")
        _at_least(self, "warmup", 1)
        _at_least(self, "settle_steps", 0)
        _at_least(self, "safety_factor", 1, " (timeouts: this x the observed 99th percentile)")
        _at_least(self, "max_timeout", self.min_timeout, " (failure.hang.min_timeout)")
        _require(
            self.timeout is None or self.timeout > 0,
            g,
            "timeout",
            self.timeout,
            "must be > 0 seconds, or null to learn each section's timeout from the run",
        )


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
    action: str = "none"
    """none | restart (a persistent straggler ends the attempt like a failed worker)."""

    def __post_init__(self) -> None:
        g = self._group
        _at_least(self, "patience", 1)
        _require(
            self.threshold > 1,
            g,
            "threshold",
            self.threshold,
            "must be > 1 (a slowdown against the fastest rank, e.g. 1.3)",
        )
        _require(
            self.action in STRAGGLER_ACTIONS,
            g,
            "action",
            self.action,
            f"must be one of {list(STRAGGLER_ACTIONS)}",
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
        _at_least(self, "attempts", 0, " (0 = no restart-loop guard)")
        _at_least(self, "min_steps", 1)


# Flat failure.* keys of earlier versions -> where they live now. They still work, with one
# line that says so.
RENAMED_FAILURE_KEYS = {
    "hang_detection": "hang.enabled",
    "hang_timeout": "hang.timeout",
    "hang_safety_factor": "hang.safety_factor",
    "hang_min_timeout": "hang.min_timeout",
    "hang_max_timeout": "hang.max_timeout",
    "hang_warmup": "hang.warmup",
    "heartbeat_interval": "hang.heartbeat_interval",
    "straggler_threshold": "straggler.threshold",
    "straggler_patience": "straggler.patience",
    "straggler_action": "straggler.action",
    "restart_loop_attempts": "restart_loop.attempts",
    "restart_loop_min_steps": "restart_loop.min_steps",
}
_said: set[str] = set()


def say_deprecated(old: str, new: str) -> None:
    """One line on stderr, once per process, for a key spelled the old way."""
    if old not in _said:
        _said.add(old)
        print(f"ftjob: {old} is deprecated: it is {new} now", file=sys.stderr)


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
    # The keys of RENAMED_FAILURE_KEYS, as earlier versions spelled them (null: not given).
    hang_detection: bool | None = None
    hang_timeout: float | None = None
    hang_safety_factor: float | None = None
    hang_min_timeout: float | None = None
    hang_max_timeout: float | None = None
    hang_warmup: int | None = None
    heartbeat_interval: float | None = None
    straggler_threshold: float | None = None
    straggler_patience: int | None = None
    straggler_action: str | None = None
    restart_loop_attempts: int | None = None
    restart_loop_min_steps: int | None = None

    def __post_init__(self) -> None:
        renamed = set()
        for old, new in RENAMED_FAILURE_KEYS.items():
            value = getattr(self, old)
            if value is None:
                continue
            section, key = new.split(".")
            setattr(getattr(self, section), key, value)
            setattr(self, old, None)
            renamed.add(section)
            say_deprecated(f"{self._group}.{old}", f"{self._group}.{new}")
        for section in renamed:  # the value rules, on the values given the old way
            getattr(self, section).__post_init__()
        g = self._group
        for key in ("max_failures", "max_preemptions"):
            value = getattr(self, key)
            _require(value >= -1, g, key, value, "must be >= 0, or -1 for unlimited")
        for key in ("preemption_poll_interval", "health_check_interval"):
            _require(getattr(self, key) > 0, g, key, getattr(self, key), "must be > 0 seconds")
        _at_least(self, "preemption_grace_s", 0, " seconds")
        _require(
            self.expected_mtbf_s is None or self.expected_mtbf_s > 0,
            g,
            "expected_mtbf_s",
            self.expected_mtbf_s,
            "must be > 0 seconds (the mean time between failures you expect), or null",
        )


LOGGER_BACKENDS = {  # backend -> (module it needs, the extra that installs it)
    "csv": (None, None),
    "tensorboard": ("tensorboard", "pip install 'ftjob[tensorboard]'"),
    "mlflow": ("mlflow", "pip install 'ftjob[mlflow]'"),
    "wandb": ("wandb", "pip install 'ftjob[wandb]'"),
}
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggerConfig:
    """Experiment loggers, fed by the driver from the run ledger (see ftjob.reporting.loggers)."""

    _group: ClassVar[str] = "logger"
    backends: list[str] = field(default_factory=list)
    dir: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "ftjob"
    wandb_project: str = "ftjob"
    wandb_mode: str | None = None

    def __post_init__(self) -> None:
        for backend in self.backends:
            _require(
                backend in LOGGER_BACKENDS,
                self._group,
                "backends",
                self.backends,
                f"each must be one of {sorted(LOGGER_BACKENDS)}",
            )
            module, extra = LOGGER_BACKENDS[backend]
            _require(
                module is None or importlib.util.find_spec(module) is not None,
                self._group,
                "backends",
                self.backends,
                f"{backend} needs the {module} package: {extra}",
            )
        _require(
            self.wandb_mode is None or self.wandb_mode in WANDB_MODES,
            self._group,
            "wandb_mode",
            self.wandb_mode,
            f"must be one of {list(WANDB_MODES)}, or null for WANDB_MODE / wandb's default",
        )


@dataclass
class RayConfig:
    _group: ClassVar[str] = "ray"
    address: str | None = None
    local_nodes: int = 1
    num_cpus: int | None = None
    node_cpus: int = 2
    replace_delay: float = 5.0
    replace_nodes: bool = True  # simulated cluster: killed nodes come back after replace_delay
    log_to_driver: bool = False
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
        _require(
            self.health_check_period_ms is None or self.health_check_period_ms >= 100,
            g,
            "health_check_period_ms",
            self.health_check_period_ms,
            "must be >= 100 ms, or null for Ray's default (3000)",
        )
        _require(
            self.health_check_failure_threshold is None or self.health_check_failure_threshold >= 1,
            g,
            "health_check_failure_threshold",
            self.health_check_failure_threshold,
            "must be >= 1, or null for Ray's default (5)",
        )
        _require(
            self.object_pull_timeout_ms is None or self.object_pull_timeout_ms >= 100,
            g,
            "object_pull_timeout_ms",
            self.object_pull_timeout_ms,
            "must be >= 100 ms, or null for Ray's default (10000)",
        )
        _require(
            self.local_nodes >= 1,
            g,
            "local_nodes",
            self.local_nodes,
            "must be >= 1 (1 = one local node)",
        )
        _require(
            self.num_cpus is None or self.num_cpus >= 1,
            g,
            "num_cpus",
            self.num_cpus,
            "must be >= 1 or null",
        )
        _require(self.node_cpus >= 1, g, "node_cpus", self.node_cpus, "must be >= 1")
        _at_least(self, "resources_timeout", 0, " seconds (0 = refuse at once what does not fit)")
        _require(
            self.replace_delay >= 0, g, "replace_delay", self.replace_delay, "must be >= 0 seconds"
        )
        _require(
            self.address is None or self.local_nodes == 1,
            g,
            "local_nodes",
            self.local_nodes,
            "a simulated cluster (local_nodes > 1) cannot be combined with ray.address",
        )


PRECISIONS = ("fp32", "bf16")
DECODE_PLACES = ("auto", "worker", "ray")
PLACEMENTS = ("PACK", "SPREAD")


@dataclass
class TrainerConfig:
    _group: ClassVar[str] = "trainer"
    num_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    epochs: int = 3
    batch_size: int = 32
    val_batch_size: int | None = None
    lr: float = 1e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    warmup_epochs: float = 0.0
    lr_reference_batch: int | None = None
    label_smoothing: float = 0.0
    weight_decay_norm_and_bias: bool = True
    validate_every_n_steps: int = 0
    checkpoint_every_n_steps: Any = 0  # steps, or "auto"
    log_every_n_steps: int = 10
    seed: int = 0
    audit_samples: bool = False
    stop_on_nonfinite_loss: bool = True
    prefetch_batches: int = 2
    validation_cache_mb: int = 512
    decode_cpus: float = 1.0
    decode_window_mb: float = 256
    decode_in: str = "auto"  # worker | ray | auto: where training and validation batches decode
    precision: str = "fp32"
    channels_last: bool = False
    placement: str | None = None
    min_workers: int | None = None  # elastic: train on as few as this; num_workers is the most
    resize_interval: float = 60.0  # elastic: how often a running group checks for capacity

    def __post_init__(self) -> None:
        g = self._group
        for key, minimum, note in (
            ("num_workers", 1, ""),
            ("epochs", 1, ""),
            ("batch_size", 1, " (per worker)"),
            ("warmup_steps", 0, ""),
            ("validate_every_n_steps", 0, " (0 = at the end of each epoch only)"),
            ("log_every_n_steps", 1, ""),
            ("prefetch_batches", 0, ""),
            (
                "validation_cache_mb",
                0,
                " (0 = read and decode the validation set at every validation)",
            ),
        ):
            _at_least(self, key, minimum, note)
        every = self.checkpoint_every_n_steps
        _require(
            every == "auto" or (type(every) is int and every >= 0),
            g,
            "checkpoint_every_n_steps",
            every,
            "must be a number of steps >= 0 (0 = at the end of each epoch only), or auto (the "
            "interval that wastes least for the measured checkpoint cost and "
            "failure.expected_mtbf_s)",
        )
        _require(
            self.val_batch_size is None or self.val_batch_size >= 1,
            g,
            "val_batch_size",
            self.val_batch_size,
            "must be >= 1, or null for batch_size",
        )
        self._check_optimisation()
        _require(self.decode_cpus > 0, g, "decode_cpus", self.decode_cpus, "must be > 0")
        _require(
            self.decode_in in DECODE_PLACES,
            g,
            "decode_in",
            self.decode_in,
            f"must be one of {list(DECODE_PLACES)} (auto: in the training process when the "
            "cluster is one machine whose cores the CPU training workers hold, else in Ray Data)",
        )
        _require(
            self.decode_window_mb > 0,
            g,
            "decode_window_mb",
            self.decode_window_mb,
            "must be > 0 (decoded data per worker held ahead of training, in MB)",
        )
        _require(
            self.precision in PRECISIONS,
            g,
            "precision",
            self.precision,
            f"must be one of {list(PRECISIONS)}",
        )
        self._check_resources()
        self._check_elastic()

    def _check_elastic(self) -> None:
        """Every world size the group may run at must split the global batch evenly: each
        rank trains the same share of every global batch, so the averaged gradient is the
        global batch's."""
        g, low = self._group, self.min_workers
        _require(
            low is None or 1 <= low <= self.num_workers,
            g,
            "min_workers",
            low,
            f"must be between 1 and trainer.num_workers={self.num_workers} (the most workers), or "
            "null for a fixed-size group",
        )
        _require(
            self.resize_interval > 0,
            g,
            "resize_interval",
            self.resize_interval,
            "must be > 0 seconds",
        )
        if low is None:
            return
        uneven = [w for w in range(low, self.num_workers + 1) if self.global_batch_size % w]
        _require(
            not uneven,
            g,
            "min_workers",
            low,
            f"the global batch {self.global_batch_size} (trainer.batch_size x trainer.num_workers) "
            f"does not split evenly over {uneven[0] if uneven else 0} workers: raise "
            "trainer.min_workers, or choose a batch_size that every world size from min_workers "
            "to num_workers divides",
        )

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    def _check_optimisation(self) -> None:
        g = self._group
        _require(
            self.lr > 0 and math.isfinite(self.lr), g, "lr", self.lr, "must be a finite number > 0"
        )
        _require(
            self.lr_schedule in LR_SCHEDULES,
            g,
            "lr_schedule",
            self.lr_schedule,
            f"must be one of {list(LR_SCHEDULES)}",
        )
        _at_least(self, "warmup_epochs", 0)
        _require(
            self.lr_reference_batch is None or self.lr_reference_batch >= 1,
            g,
            "lr_reference_batch",
            self.lr_reference_batch,
            "must be >= 1 (the global batch trainer.lr is meant for, e.g. 256), or null",
        )
        _require(
            0 <= self.label_smoothing < 1,
            g,
            "label_smoothing",
            self.label_smoothing,
            "must be in [0, 1)",
        )

    def _check_resources(self) -> None:
        g = self._group
        _require(
            self.placement is None or self.placement in PLACEMENTS,
            g,
            "placement",
            self.placement,
            f"must be one of {list(PLACEMENTS)}, or null (SPREAD on a simulated cluster, else PACK)",
        )
        gpus = self.resources_per_worker.get("GPU", 0)
        _require(
            self.use_gpu or not gpus,
            g,
            "resources_per_worker",
            self.resources_per_worker,
            f"asks for {gpus:g} GPU per worker while trainer.use_gpu=false: set trainer.use_gpu=true, "
            "or drop the GPU with '~trainer.resources_per_worker.GPU'",
        )
        bad = {k: v for k, v in self.resources_per_worker.items() if v < 0}
        _require(
            not bad, g, "resources_per_worker", self.resources_per_worker, "amounts must be >= 0"
        )

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_workers

    @property
    def worker_cpus(self) -> float:
        return float(self.resources_per_worker.get("CPU", 1.0))


# A run name becomes a directory of the run's storage and of every node's scratch: it must never
# climb out of them (``..``), hide (``.x``), or be expanded as a glob pattern (``[``, ``*``, ``?``).
RUN_NAME = re.compile(r"(?!\.)[A-Za-z0-9._-]{1,128}")


def validate_run_name(name: str | None, key: str = "name") -> None:
    """Refuse a run name outside the safe set (letters, digits, ``._-``; not starting with a
    dot; 1-128 characters)."""
    _require(
        name is None or (isinstance(name, str) and RUN_NAME.fullmatch(name) is not None),
        "",
        key,
        name,
        "a run name is 1-128 letters, digits, '.', '_' or '-', not starting with '.' "
        "(it names directories of the run's storage): choose e.g. name=exp-1",
    )


@dataclass
class JobConfig:
    """The whole job. ``model``, ``dataset`` and ``optimizer`` are ``_target_`` nodes: the
    dataset is built on the driver, the model and optimizer in each worker (the model with the
    dataset's ``num_classes``, the optimizer as a partial called with the model's parameters
    and ``trainer.lr``)."""

    model: dict[str, Any] = MISSING
    dataset: dict[str, Any] = MISSING
    optimizer: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "torch.optim.AdamW", "_partial_": True}
    )
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    name: str | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        _require(
            not self.resume or bool(self.name),
            "",
            "resume",
            self.resume,
            "resume=true continues the run called `name`: set name=RUN_NAME too",
        )
        validate_run_name(self.name)
        if self.chaos.kind in ("node", "preempt") and self.chaos.enabled:
            _require(
                self.ray.local_nodes > 1 or self.ray.address is not None,
                "chaos",
                "kind",
                self.chaos.kind,
                f"{self.chaos.kind} chaos takes nodes away: it needs a multi-node cluster: set "
                "ray.local_nodes=3 (simulated) or ray.address",
            )
        _require(
            self.trainer.checkpoint_every_n_steps != "auto" or bool(self.failure.expected_mtbf_s),
            "failure",
            "expected_mtbf_s",
            self.failure.expected_mtbf_s,
            "trainer.checkpoint_every_n_steps=auto picks the interval for a failure rate: declare "
            "it, e.g. failure.expected_mtbf_s=3600 (seconds between failures you expect)",
        )
        _require(
            self.chaos.kind != "hang" or not self.chaos.enabled or self.failure.hang.enabled,
            "failure.hang",
            "enabled",
            self.failure.hang.enabled,
            "chaos.kind=hang stops a worker that nothing resumes: only hang detection ends it; "
            "set failure.hang.enabled=true",
        )
        self._check_storage_on_cluster()
        if self.checkpoint.storage_path:
            check_backend(self.checkpoint.storage_path, "checkpoint.storage_path")
        dataset_path = self.dataset.get("path")
        if isinstance(dataset_path, str) and not _is_placeholder(dataset_path):
            check_backend(dataset_path, "dataset.path")
        for group in TARGET_GROUPS:
            check_group_target(getattr(self, group), group)
        if self.chaos.enabled and self.chaos.kind in ("node", "preempt"):
            _require(
                self.ray.address is None or self.chaos.allow_on_existing_cluster,
                "chaos",
                "allow_on_existing_cluster",
                self.chaos.allow_on_existing_cluster,
                f"chaos.kind={self.chaos.kind} SIGKILLs raylets of the cluster at "
                f"ray.address={self.ray.address!r}, and every other job's work on those nodes "
                "with them: set chaos.allow_on_existing_cluster=true if this cluster is yours "
                "to break (or test on a simulated one: drop ray.address, set ray.local_nodes=3)",
            )

    def _check_storage_on_cluster(self) -> None:
        """On an existing cluster, nodes other than the driver's cannot read the driver's
        disk: a checkpoint there is lost to every other node (after a node kill, training
        would silently start over). Object stores, and paths every node mounts, work."""
        path = self.checkpoint.storage_path
        local = path is None or fsspec_protocol(path) in ("file", "local")
        if self.ray.address is None or not local or self.checkpoint.shared_filesystem:
            return
        raise ConfigError(
            "checkpoint.storage_path",
            path,
            f"with ray.address={self.ray.address!r} checkpoints must be on storage every node "
            "reaches: set checkpoint.storage_path to a URL (s3://bucket/prefix, gs://...), or to "
            "a path mounted on every node and declare it with checkpoint.shared_filesystem=true",
            supply=path is None,
        )


def refuse_non_finite(config: Any, prefix: str = "") -> None:
    """Every number of the schema is finite: ``inf`` passes every ``>= x`` rule, then overflows
    a timer (a lease renewal thread dies on it) or an allocation; ``nan`` passes none and
    compares false everywhere. Where "no limit" is meant, a key takes null."""
    for f in fields(config):
        value, key = getattr(config, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            refuse_non_finite(value, f"{key}.")
        elif f.type == "dict[str, float]":
            for name, amount in value.items():
                _require_finite(f"{key}.{name}", amount)
        else:
            _require_finite(key, value)


def _require_finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, value, "must be a finite number (null where a key means no limit)")


# Keys Hydra's instantiate reads itself.
_HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


def fsspec_protocol(url: str) -> str:
    """``s3`` for ``s3://b/k``, ``file`` for a plain path (fsspec's rule, without importing it)."""
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    return match.group(1).lower() if match else "file"


# The package that brings each storage backend ftjob names in its errors (fsspec's own message
# names the module).
INSTALL_HINTS = {
    "gs": "pip install 'ftjob[gcs]'",
    "gcs": "pip install 'ftjob[gcs]'",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}


def check_backend(url: str, key: str) -> None:
    """The fsspec backend for ``url`` is known and installed (without touching the storage)."""
    import fsspec

    protocol = fsspec_protocol(url)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(protocol, "install the fsspec package it names")
        raise ConfigError(
            key, url, f"the {protocol}:// backend is not installed ({exc}): {hint}"
        ) from None
    except ValueError:
        raise ConfigError(
            key, url, f"unknown storage protocol {protocol}://: use a path, s3://, gs://, ..."
        ) from None


# The `_target_` groups, and the arguments ftjob passes to each itself (the node must not set
# them; the target must accept them).
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("num_classes",),
    "dataset": (),
    "optimizer": ("params", "lr"),
}


def check_group_target(node: dict[str, Any], group: str) -> Callable[..., Any]:
    passed = TARGET_GROUPS[group]
    return check_target(node, group, skip=passed, needs=passed)


def check_target(
    node: dict[str, Any], group: str, skip: tuple[str, ...] = (), needs: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """Import ``node['_target_']`` and bind the node's other keys to its signature; ``needs``
    are arguments ftjob passes itself, which the target must accept."""
    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(
            f"{group}._target_", target, "must name the class or function that builds the " + group
        )
    obj = import_target(target, f"{group}._target_")
    kwargs = {k: v for k, v in node.items() if k not in _HYDRA_KEYS and k not in skip}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return obj
    params = [p for p in signature.parameters if p not in skip and p != "self"]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    refused = [n for n in needs if n not in signature.parameters and not takes_any]
    if refused:
        raise ConfigError(
            f"{group}._target_",
            target,
            f"takes no {refused[0]!r} argument, which ftjob passes to every {group} "
            f"(it takes {params})",
        )
    unknown = [k for k in kwargs if k not in signature.parameters]
    if unknown and not takes_any:
        raise ConfigError(
            f"{group}.{unknown[0]}",
            kwargs[unknown[0]],
            f"{target} takes no such argument; it takes {params}",
        )
    try:
        bound = signature.bind_partial(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            group, sorted(kwargs), f"{target} cannot take these keys ({exc}); it takes {params}"
        ) from None
    check_args = getattr(obj, "check_args", None)
    if callable(check_args) and not any(_is_placeholder(v) for v in kwargs.values()):
        arguments = {
            name: p.default
            for name, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        arguments.update(bound.arguments)
        check_args(**arguments)
    return obj


def _is_placeholder(value: Any) -> bool:
    # A `???` value that `python -m ftjob.check` stands in for: the node is checked at run time.
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def import_target(path: str, key: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            key, path, f"cannot be imported ({exc}); is the module installed or on PYTHONPATH?"
        ) from None


def _check_known_keys(node: Any, schema: type, prefix: str = "") -> None:
    """Keys added with ``+group.key=...`` pass Hydra's struct mode; refuse them here."""
    known = {f.name: f for f in fields(schema)}
    for key in node:
        full = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(
                full,
                OmegaConf.select(node, str(key), throw_on_missing=False),
                f"unknown key: {schema.__name__} has {sorted(known)}",
            )
        child = node[key] if not OmegaConf.is_missing(node, key) else None
        sub = known[key].type
        sub_type = globals().get(sub) if isinstance(sub, str) else sub
        if isinstance(child, DictConfig) and is_dataclass(sub_type):
            _check_known_keys(child, sub_type, f"{full}.")


def load_job(cfg: DictConfig) -> JobConfig:
    """Turn a composed config into a validated JobConfig, or raise ConfigError (one line)."""
    _check_known_keys(cfg, JobConfig)
    try:
        job = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except MissingMandatoryValue as exc:
        key = exc.full_key or "?"
        raise ConfigError(
            key, "???", _MISSING_HINTS.get(key, f"is required: set {key}=VALUE")
        ) from None
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        key = getattr(exc, "full_key", None) or "config"
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(key, getattr(exc, "value", None), message) from None
    assert isinstance(job, JobConfig)
    return job


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (JSON-safe): what workers and checkpoints carry."""
    if is_dataclass(obj) and not isinstance(obj, type):
        renamed = RENAMED_FAILURE_KEYS if isinstance(obj, FailureConfig) else {}
        return {
            f.name: to_plain(getattr(obj, f.name)) for f in fields(obj) if f.name not in renamed
        }
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def register_schema() -> None:
    """Register the schema so conf/config.yaml can extend it (defaults: - ftjob_schema)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="ftjob_schema", node=JobConfig)
