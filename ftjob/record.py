"""The run record: what the run ledger keeps of a run, as typed, frozen data.

Every event a training worker, the chaos killer or the driver tells the ledger is one of these
records, and the ledger's snapshot (:class:`RunSnapshot`) is made of them; the reports
(``ftjob.reporting``) and the restart-loop rule read them by attribute, so a renamed field
breaks at type-check time, not in the middle of a run. Each record has one JSON form
(:meth:`Record.to_json` / :meth:`Record.from_json`), the one summary.json has always shown:
field names are the JSON keys (``from_`` is written ``from``), and an optional field marked
:func:`optional` is left out while it is None.

:class:`WorkerLedger` is the part of the ledger's API a training worker calls
(``ftjob.worker.recorder`` calls it through these typed methods; the ledger implements it).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, Union

from ftjob.config.choices import Choice

R = TypeVar("R", bound="Record")


def optional(*, key: str | None = None) -> Any:
    """A field that defaults to None and is left out of the JSON form while it is None."""
    return field(default=None, metadata={"omit_none": True, **({"key": key} if key else {})})


def renamed(key: str, default: Any = None) -> Any:
    """A field whose JSON key is not a Python name (``from``)."""
    return field(default=default, metadata={"key": key})


def flattened() -> Any:
    """A record field (default None) whose fields are its parent's in the JSON form, there
    only while it is set: a part of a record that some of its kind have (a failure's
    recovery, which a failure the run died of has not)."""
    return field(default=None, metadata={"flatten": True})


def empty_when_none() -> Any:
    """A record field (default None) written as ``{}`` while it is None, as summary.json has
    always had it."""
    return field(default=None, metadata={"empty_when_none": True})


class Record:
    """JSON (de)serialisation for the frozen dataclasses below, from their type hints."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("flatten"):
                out.update(value.to_json() if value is not None else {})
                continue
            if value is None and f.metadata.get("omit_none"):
                continue
            if value is None and f.metadata.get("empty_when_none"):
                out[f.name] = {}
                continue
            out[f.metadata.get("key", f.name)] = _encode(value)
        return out

    @classmethod
    def from_json(cls: type[R], data: typing.Mapping[str, object]) -> R:
        hints = field_types(cls)
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            key = f.metadata.get("key", f.name)
            if f.metadata.get("flatten"):
                part = record_type(hints[f.name])
                if any(k in data for k in json_keys(part)):
                    kwargs[f.name] = part.from_json(data)
            elif key in data:
                empty = f.metadata.get("empty_when_none") and data[key] == {}
                kwargs[f.name] = None if empty else _decode(hints[f.name], data[key])
        return cls(**kwargs)


def record_type(hint: Any) -> type[Record]:
    """The record class of a field typed ``SomeRecord`` or ``SomeRecord | None``."""
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(kinds) != 1 or not (isinstance(kinds[0], type) and issubclass(kinds[0], Record)):
        raise TypeError(f"{hint} is not a record type")
    return kinds[0]


def json_keys(cls: type[Record]) -> list[str]:
    """The keys of a record's JSON form, in order (a flattened part's in its place)."""
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            keys += json_keys(record_type(field_types(cls)[f.name]))
        else:
            keys.append(f.metadata.get("key", f.name))
    return keys


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """A record class's fields' types (resolved once)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _encode(value: object) -> object:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return _decode(kinds[0], value) if len(kinds) == 1 else value
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin is tuple and (len(args) != 2 or args[1] is not Ellipsis):  # (step, digest)
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin is tuple:
        return tuple(_decode(args[0], v) for v in value)
    if origin is list:
        return [_decode(args[0], v) for v in value]
    if origin is dict:
        key, item = args
        return {
            _decode(key, k) if key is not str else k: _decode(item, v) for k, v in value.items()
        }
    if hint is int and isinstance(value, str):
        return int(value)  # a JSON object's key
    if hint is float and isinstance(value, int):
        return float(value)
    return value


# -- what the run is -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan(Record):
    """The run's shape, known before the first worker starts (zeros: a run that never
    reached the cluster)."""

    num_samples: int = 0
    global_batch_size: int = 0
    samples_per_epoch: int = 0
    steps_per_epoch: int = 0
    seed: int = 0
    epochs: int = 0
    num_workers: int | None = None  # the most (elastic: min_workers the fewest)
    # Row-grouped data (dataset.shuffle_window > 0): the epoch order's row groups, as runs of
    # group_sizes[i] rows repeated group_counts[i] times, and the samples shuffled together.
    group_sizes: tuple[int, ...] = ()
    group_counts: tuple[int, ...] = ()
    shuffle_window: int = 0


# -- an attempt: one worker group, from its start to its end ---------------------------------


class Tier(Choice):
    """Where a restore came from."""

    storage = "storage"
    memory = "memory"


class Holder(Choice):
    """Which copy a restore read: this node's snapshot holder, a surviving peer node's, or
    (no snapshot) storage."""

    local = "local"
    peer = "peer"
    storage = "storage"


class RunStatus(Choice):
    """How a run ended (summary.json ``status``)."""

    succeeded = "succeeded"
    failed = "failed"  # and why: summary.json ``error``
    interrupted = "interrupted"  # Ctrl-C
    preempted = "preempted"  # a preemption notice stopped it (resume to continue)


class NoticeSource(Choice):
    """Who gave an agreed notice. A real preemption outranks a planned resize."""

    resize = "resize"  # not a preemption: the elastic group is about to be resized
    drain = "drain"  # Ray Train: a node of the run is being drained
    driver = "driver"  # the driver got SIGTERM
    worker = "worker"  # a training worker process got SIGTERM


@dataclass(frozen=True)
class WorkerPlace(Record):
    """Where a training rank runs: chaos and hang handling target it."""

    node_id: str
    pid: int
    raylet_pid: int = 0  # a Ray worker's parent is its node's raylet
    time: float = 0.0  # when the rank registered
    rank: int | None = optional()  # set where a list of places is handed out


@dataclass(frozen=True)
class Fallback(Record):
    """A checkpoint a restore could not use, and where it went."""

    step: int
    path: str
    reason: str
    committed: bool = True
    quarantined_to: str | None = optional()
    left: str | None = optional()  # why it was left in place


@dataclass(frozen=True)
class Restore(Record):
    """An attempt's restore: the state it went back to, where from, and what each part took."""

    step: int
    epoch: int
    position: int
    path: str | None
    download: float = 0.0
    load: float = 0.0
    skip: float = 0.0  # moving the data iterator to the position
    skipped: tuple[Fallback, ...] = ()
    tier: Tier = Tier.storage
    holder: Holder | None = optional()  # local | peer (tier memory) | storage


@dataclass(frozen=True)
class FirstStep(Record):
    """An attempt's first trained step: when it ended, what it took (its batch wait and the
    step), and rank 0's set-up phases before it."""

    step: int
    time: float
    took: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class JitCheckpoint(Record):
    """A just-in-time checkpoint after a notice: its path, or why there is none."""

    step: int
    path: str | None = None
    reason: str | None = None  # why there is none, or why the upload failed
    reused: bool | None = optional()  # the periodic checkpoint of this step was already in
    seconds: float = 0.0
    time: float | None = optional()


@dataclass(frozen=True)
class Notice(Record):
    """A notice every rank agreed on: a preemption (its source, deadline) or a planned resize
    (with the request it serves), and the just-in-time checkpoint that followed it."""

    source: NoticeSource
    # Second in the JSON form, as summary.json has always had it; a keyword when constructed.
    deadline: float | None = field(default=None, kw_only=True)
    received: float
    step: int
    ranks: tuple[int, ...] = ()
    validation_cut: int | None = None  # a validation the notice cut short
    from_: int | None = optional(key="from")  # a resize: the world size it leaves
    to: int | None = optional()  # ... and the one it goes to
    requested: float | None = optional()  # ... when the scaling policy asked for it
    jit: JitCheckpoint | None = optional()


@dataclass(frozen=True)
class Attempt(Record):
    """One worker group's run, from Ray Train's (re)start of the train function."""

    index: int
    started: float
    world_size: int | None = None
    workers: dict[int, WorkerPlace] = field(default_factory=dict)
    restored: Restore | None = None
    preemption: Notice | None = None  # ended by a preemption notice
    resize: Notice | None = None  # ended by a planned resize
    first_step: FirstStep | None = None
    max_step: int = 0  # the furthest step it trained

    @property
    def planned_end(self) -> bool:
        """It ended by a notice or a planned resize, not by a failure."""
        return self.preemption is not None or self.resize is not None

    @property
    def continued_from(self) -> int | None:
        """The step this attempt continued the run from: its restore's, 0 for a start from
        scratch; None for one that stopped at its start (the run lost to another driver, a
        fatal error found there) -- it restored nothing and trained nothing, so the run
        still stands where the attempt before it left it."""
        if self.restored is not None:
            return self.restored.step
        return 0 if self.first_step is not None else None


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress(Record):
    """Rank 0's progress point (every trainer.log_every_n_steps)."""

    step: int
    epoch: int
    epochs: int
    total_steps: int
    loss: float | None
    throughput: float
    lr: float
    time: float | None = None
    attempt: int | None = optional()


@dataclass(frozen=True)
class HistoryPoint(Record):
    """A progress point that survived: each step's version from the attempt that kept it."""

    step: int
    time: float | None
    attempt: int
    loss: float | None = None
    throughput: float | None = None
    lr: float | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class StepRecord(Record):
    """A point for the experiment loggers: a train or a validation step's values."""

    kind: str  # "train" | "validation"
    attempt: int
    step: int
    values: dict[str, float | None]


@dataclass(frozen=True)
class ValidationResult(Record):
    """A validation pass over the whole validation stream."""

    epoch: int
    loss: float
    accuracy: float
    samples: int
    time: float
    step: int | None = optional()
    attempt: int | None = optional()


@dataclass(frozen=True)
class CheckpointRecord(Record):
    """An upload's outcome: committed (its path) or failed (its error)."""

    step: int
    path: str | None
    error: str | None
    seconds: float
    time: float | None = None
    attempt: int | None = optional()

    @property
    def committed(self) -> bool:
        return bool(self.path)


@dataclass(frozen=True)
class Failure(Record):
    """Ray Train noticed worker failures: when, each failed rank's error, and the attempt
    that was running then (the ledger's latest begun: its own order of messages, no clock; a
    second notice in one attempt is a restarted group that died before it began one)."""

    noticed: float
    errors: dict[int, str]
    attempt: int | None = optional()


@dataclass(frozen=True)
class KillTarget(Record):
    """What chaos hits: a node (its ranks) or one training worker."""

    node_id: str
    ranks: tuple[int, ...] | None = optional()  # a node: the ranks it runs
    pid: int | None = optional()  # a worker: its process ...
    rank: int | None = optional()  # ... and rank


@dataclass(frozen=True)
class Kill(Record):
    """A chaos event the killer carried out."""

    time: float
    kind: str  # chaos.kind
    target: KillTarget
    attempt: int | None
    notice: float | None = optional()  # preempt: the drain (the notice) ...
    deadline: float | None = optional()  # ... and when the node goes
    slowdown: float | None = optional()  # slow: the share of each step the rank sleeps
    killed_pid: int | None = optional()
    confirmed: bool | None = optional()  # a node kill: Ray declared the node dead


@dataclass(frozen=True)
class ChaosSkip(Record):
    """A kill window that ended without a kill, and why."""

    time: float
    kind: str
    reason: str
    attempt: int | None = None
    window: int | None = optional()
    target: KillTarget | None = optional()
    notice: float | None = optional()
    deadline: float | None = optional()
    slowdown: float | None = optional()
    killed_pid: int | None = optional()
    confirmed: bool | None = optional()

    @classmethod
    def of_kill(cls, kill: Kill, reason: str) -> ChaosSkip:
        """A kill that did not count (a node Ray never confirmed dead), and why."""
        fields = {f.name: getattr(kill, f.name) for f in dataclasses.fields(kill)}
        return cls(**fields, reason=reason)


@dataclass(frozen=True)
class Injected(Record):
    """A failure chaos.fail_at_steps injected."""

    time: float
    step: int


@dataclass(frozen=True)
class ChaosView(Record):
    """What the chaos killer needs: when training began, and the current attempt."""

    training_started: float | None
    attempt: int | None
    training: bool
    workers: tuple[WorkerPlace, ...]
    step: int
    started_at: int = 0  # the step this driver's first attempt restored: a continued run's


# -- the watch: hangs and stragglers ----------------------------------------------------------


@dataclass(frozen=True)
class Beat(Record):
    """A rank's heartbeat: its section, how long ago it progressed, what its sections and
    steps took since the last beat, and its storage requests completed."""

    section: str
    age: float
    step: int
    durations: dict[str, list[float]] = field(default_factory=dict)
    local: list[float] = field(default_factory=list)  # local step times (no all-reduce wait)
    io: int = -1


@dataclass(frozen=True)
class StackCapture(Record):
    """The driver's handling of a hang: the stalled worker's stack, then its end."""

    pid: int
    stack: str | None = None
    stack_source: str | None = None
    killed: bool | None = optional()
    error: str | None = optional()


@dataclass(frozen=True)
class Hang(Record):
    """A hang: the rank the attempt waits on, where it stalled, and for how long."""

    time: float
    attempt: int
    rank: int
    node_id: str
    pid: int
    section: str
    step: int
    stalled_since: float
    stalled_for_s: float
    timeout_s: float
    detection_latency_s: float
    learned: bool
    heartbeats_stopped: bool
    others: dict[int, str]  # the other ranks' sections
    stack: str | None = optional()
    stack_source: str | None = optional()
    killed: bool | None = optional()
    error: str | None = optional()

    def handled(self, result: StackCapture) -> Hang:
        return dataclasses.replace(
            self,
            stack=result.stack,
            stack_source=result.stack_source,
            killed=result.killed,
            error=result.error,
        )


@dataclass(frozen=True)
class Straggler(Record):
    """A rank slower than the fastest for failure.straggler.patience checks in a row."""

    time: float
    attempt: int
    rank: int
    node_id: str | None
    slowdown: float
    vs_own_best: float
    restarted: bool = False
    pid: int | None = optional()  # to restart it (failure.straggler.action=restart)


@dataclass(frozen=True)
class StragglerScore(Record):
    slowdown: float
    vs_own_best: float


@dataclass(frozen=True)
class StragglerReport(Record):
    flagged: tuple[Straggler, ...] = ()
    scores: dict[str, StragglerScore] = field(default_factory=dict)  # by rank
    max_slowdown: float = 0.0
    threshold: float = 0.0


@dataclass(frozen=True)
class SectionTimeout(Record):
    """A section's hang timeout: learned from its observed times, or configured."""

    observed: int
    p99_s: float | None
    timeout_s: float | None
    learned: bool


@dataclass(frozen=True)
class WatchRecord(Record):
    hangs: tuple[Hang, ...] = ()
    stragglers: StragglerReport = field(default_factory=StragglerReport)
    sections: dict[str, SectionTimeout] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # by attempt


# -- data -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditStep(Record):
    """The samples of one global step (every rank's slice), and those skipped as bad files."""

    attempt: int
    step: int
    epoch: int
    ids: tuple[int, ...]
    skipped: tuple[int, ...] | None = optional()


@dataclass(frozen=True)
class SkippedFile(Record):
    """A file skipped as bad (dataset.bad_files=skip)."""

    split: str
    id: int
    path: str
    reason: str
    attempt: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class DecodeChoice(Record):
    """Where a run's batches are decoded (``trainer.decode_in``: worker, ray or device), kept
    for the whole run -- every rank and attempt decode the same way, the same pixels -- and
    why: as set, auto's probe (each place's measured images/s in ``rates``), or a restored
    checkpoint's."""

    place: str
    reason: str
    rates: dict[str, float] = field(default_factory=dict)


# -- requests between the driver and the workers ----------------------------------------------


@dataclass(frozen=True)
class StopRequest(Record):
    reason: str
    time: float


@dataclass(frozen=True)
class ResizeRequest(Record):
    from_: int = renamed("from", 0)
    to: int = 0
    requested: float = 0.0


@dataclass(frozen=True)
class AttemptStart(Record):
    """The ledger's answer to a new attempt: its index, and why it must not train."""

    attempt: int
    stop: str | None = None


@dataclass(frozen=True)
class LogFeed(Record):
    """Step records since a cursor, and the step up to which records are settled."""

    records: tuple[StepRecord, ...]
    cursor: int
    settled: float


StorageCounters = dict[str, dict[str, float]]  # per kind of request: calls, retries, ...


# -- the whole run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSnapshot(Record):
    """Everything the ledger recorded of a run; summary.json is built from it."""

    plan: RunPlan = field(default_factory=RunPlan)
    started: float = 0.0
    finished: float | None = None
    attempts: tuple[Attempt, ...] = ()
    failures: tuple[Failure, ...] = ()
    kills: tuple[Kill, ...] = ()
    chaos_skipped: tuple[ChaosSkip, ...] = ()
    injected: tuple[Injected, ...] = ()
    validations: tuple[ValidationResult, ...] = ()
    replaced_validations: int = 0
    checkpoints: tuple[CheckpointRecord, ...] = ()
    storage: dict[str, StorageCounters] = field(default_factory=dict)  # by process
    audit: tuple[AuditStep, ...] = ()
    skipped_files: tuple[SkippedFile, ...] = ()
    decode: DecodeChoice | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    progress: Progress | None = None
    history: tuple[HistoryPoint, ...] = ()
    fatal: str | None = None
    stop_request: StopRequest | None = None
    executed_resizes: tuple[float, ...] = ()
    watch: WatchRecord = field(default_factory=WatchRecord)

    @property
    def first_step(self) -> FirstStep | None:
        """The run's first trained step (an attempt that died starting up has none)."""
        return next((a.first_step for a in self.attempts if a.first_step), None)

    def restores(self) -> list[Restore]:
        return [a.restored for a in self.attempts if a.restored is not None]

    def committed(self) -> list[CheckpointRecord]:
        return [c for c in self.checkpoints if c.committed]


def merged_audit(slices: typing.Iterable[AuditStep]) -> tuple[AuditStep, ...]:
    """Each rank's slice of a step, as the ledger received them, merged into one entry per
    (attempt, step) in that order: the ranks' ids in arrival order, their skipped ids too."""
    ids: dict[tuple[int, int], list[int]] = {}
    skipped: dict[tuple[int, int], list[int]] = {}
    epochs: dict[tuple[int, int], int] = {}
    for s in slices:
        key = (s.attempt, s.step)
        ids.setdefault(key, []).extend(s.ids)
        skipped.setdefault(key, []).extend(s.skipped or ())
        epochs[key] = s.epoch
    return tuple(
        AuditStep(key[0], key[1], epochs[key], tuple(ids[key]), tuple(skipped[key]) or None)
        for key in sorted(ids)
    )


@dataclass(frozen=True)
class RecordPull(Record):
    """What the driver pulls from the ledger as the run goes, to hold the run's record on its
    side: the snapshot without its audit, and the audit's slices since the driver's cursor
    (each rank's slice of a step as it came: the audit grows with every step, so it is sent
    once)."""

    snapshot: RunSnapshot
    audit: tuple[AuditStep, ...] = ()
    cursor: int = 0


# -- the calls a training worker makes --------------------------------------------------------


class WorkerLedger(Protocol):
    """The run ledger as a training worker calls it (through ``ftjob.worker.recorder``)."""

    def start_attempt(self, now: float, world: int | None = None) -> AttemptStart: ...
    def claim_injected_failure(self, step: int, now: float) -> bool: ...
    def notice_request(self) -> NoticeSource | None: ...
    def heartbeat(self, attempt: int, rank: int, beat: Beat) -> float: ...
    def register_worker(self, attempt: int, rank: int, place: WorkerPlace) -> None: ...
    def audit_step(
        self, attempt: int, step: int, epoch: int, ids: list[int], skipped: list[int]
    ) -> None: ...
    def skipped_files(
        self, attempt: int, rank: int, files: list[SkippedFile]
    ) -> dict[str, int]: ...
    def decode_choice(self, proposed: DecodeChoice | None) -> DecodeChoice | None: ...
    def storage_stats(self, source: str, stats: StorageCounters) -> None: ...
    def set_fatal(self, error: str) -> None: ...
    def log(self, line: str) -> None: ...
    def restored(self, attempt: int, restore: Restore) -> None: ...
    def step_done(self, attempt: int, step: int) -> None: ...
    def first_step(self, attempt: int, first: FirstStep) -> None: ...
    def progress_update(
        self, attempt: int, progress: Progress, metrics: dict[str, float]
    ) -> None: ...
    def validation(self, attempt: int, step: int, result: ValidationResult) -> None: ...
    def checkpoint(self, attempt: int, record: CheckpointRecord) -> None: ...
    def preemption_notice(self, attempt: int, notice: Notice) -> None: ...
    def jit_checkpoint(self, attempt: int, record: JitCheckpoint) -> None: ...
    def finish(self, now: float) -> None: ...
