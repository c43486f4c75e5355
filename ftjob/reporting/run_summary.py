"""summary.json as types: :class:`RunSummary` and the records it is made of -- failures,
resizes, goodput, storage counters, checkpoints, chaos, the data section, the audit, timing.

Each is a frozen :class:`ftjob.record.Record`, so its JSON form is summary.json's (field names
are the keys; ``from_`` is written ``from``; a part a record does not always have is left out
while unset, a recovery's fields inline in its failure's) and it reads back with ``from_json``
-- also a summary.json of an older run, or of a job that never started (what is missing is
its default). The reports (:mod:`ftjob.reporting.summary`, :mod:`ftjob.reporting.timeline`, the
loggers, ``python -m ftjob.report``) and the command line read these by attribute; the schema
summary.json keeps is generated from them (:mod:`ftjob.reporting.schema`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from ftjob import metrics as M
from ftjob.record import (
    ChaosSkip,
    DecodeChoice,
    Fallback,
    Hang,
    HistoryPoint,
    Holder,
    Injected,
    JitCheckpoint,
    Kill,
    KillTarget,
    Notice,
    Progress,
    Record,
    RunStatus,
    SectionTimeout,
    SkippedFile,
    Straggler,
    StragglerReport,
    Tier,
    ValidationResult,
    empty_when_none,
    flattened,
    optional,
    renamed,
)

PREEMPTION = "preemption"  # the kind of a failure record that a notice came before
FIXED_KEYS = "keys"  # a dict field's metadata: exactly these keys, always


# -- failures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InjectedDetail(Record):
    """A failure chaos.fail_at_steps injected: at which step."""

    step: int


Detail = KillTarget | Hang | Straggler | InjectedDetail


def detail_from_json(data: typing.Mapping[str, object]) -> Detail:
    """A failure's origin as summary.json has it: a hang, a straggler restarted, a kill's
    target, or an injected failure's step (each told apart by a key only it has)."""
    if "stalled_since" in data:
        return Hang.from_json(data)
    if "vs_own_best" in data:
        return Straggler.from_json(data)
    if "node_id" in data:
        return KillTarget.from_json(data)
    return InjectedDetail.from_json(data)


@dataclass(frozen=True, kw_only=True)
class Recovery(Record):
    """What recovering from a failure took, in the attempt after it."""

    restart_s: float | None = None  # noticed -> the new worker group in the train function
    restored_step: int = 0
    checkpoint: str | None = None
    tier: Tier | None = None  # storage | memory
    holder: Holder | None = None  # local | peer | storage
    fallbacks: tuple[Fallback, ...] = ()
    download_s: float = 0.0
    load_s: float = 0.0
    skip_s: float = 0.0
    restoration_s: float = 0.0
    lost_steps: int = 0
    first_step_s: float = 0.0
    time_to_recover_s: float | None = None  # origin -> the first trained step after it
    phases: dict[str, float] = field(default_factory=dict)
    lost_window_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class PreemptionPart(Record):
    """A failure a notice came before: the just-in-time checkpoint and the notice."""

    jit: JitCheckpoint | None = None
    notice: Notice  # without its jit


@dataclass(frozen=True, kw_only=True)
class FailureRecord(Record):
    """One failure a run recovered from or died of: where it came from, and what each part
    of the recovery cost (:func:`ftjob.reporting.failures.failure_records`)."""

    attempt: int
    time: float | None  # the origin: the kill, injected failure or hang behind it, or noticed
    kind: str  # worker_kill | node_kill | injected | hang | straggler | preemption | error
    detail: Detail | None = None
    error: str | None = None
    detection_s: float | None = None  # origin -> Ray Train noticed it
    recovered: bool = False
    recovery: Recovery | None = flattened()  # none: no attempt came after it
    preemption: PreemptionPart | None = flattened()

    @property
    def lost_steps(self) -> int:
        return self.recovery.lost_steps if self.recovery is not None else 0

    @property
    def time_to_recover_s(self) -> float | None:
        return self.recovery.time_to_recover_s if self.recovery is not None else None

    @classmethod
    def from_json(cls, data: typing.Mapping[str, object]) -> FailureRecord:
        detail = data.get("detail")
        record = super().from_json({k: v for k, v in data.items() if k != "detail"})
        if not isinstance(detail, dict):
            return record
        return dataclasses.replace(record, detail=detail_from_json(detail))


# -- resizes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedResize(Record):
    """A planned resize's checkpoint of its step (None: the workers did not agree in time)."""

    checkpoint: str | None


@dataclass(frozen=True, kw_only=True)
class ResizeRecord(Record):
    """A change of world size between attempts (:mod:`ftjob.reporting.resizes`)."""

    attempt: int
    kind: str  # grow | shrink
    from_: int = renamed("from", 0)
    to: int = 0
    cause: str = "failure"  # failure | planned
    lost_steps: int = 0
    planned: PlannedResize | None = flattened()
    time: float | None = None  # when it began: the notice to resize, or the failure
    time_to_recover_s: float | None = None
    first_step_s: float = 0.0


# -- goodput ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Buckets(Record):
    """Seconds of the wall clock by cause; they sum to it (:mod:`ftjob.reporting.goodput`)."""

    startup: float = 0.0  # launch -> first training step
    training: float = 0.0  # training steps that count
    data_wait: float = 0.0  # steps waiting for their batch
    validation: float = 0.0
    checkpoint: float = 0.0  # training waiting for checkpoint save, upload, report; snapshots
    detection: float = 0.0  # failure -> Ray Train noticed it
    restart: float = 0.0  # noticed -> new worker group in the train function
    restore: float = 0.0  # checkpoint download, load, data position
    setup: float = 0.0  # restored -> first step (model, process group, first batch)
    redone: float = 0.0  # steps trained again after a restore
    preemption: float = 0.0  # notice -> the node went (just-in-time checkpoint, then waiting)
    resize: float = 0.0  # a planned resize: its checkpoint -> the resized group's first step
    shutdown: float = 0.0  # last step -> the run's end
    other: float = 0.0  # what none of them explains

    def seconds(self) -> dict[str, float]:
        """Every bucket by name, in order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, kw_only=True)
class Prediction(Record):
    """The first-order model's ETTR for the run's measurements (:func:`predict_ettr`)."""

    ettr: float
    checkpoint_cost_s: float
    interval_s: float
    restorable_every_s: float
    recovery_s: float
    expected_failures: int | float  # a kill schedule's cap is a count (kept an int in JSON)
    optimal_interval_s: float | None


@dataclass(frozen=True, kw_only=True)
class Goodput(Record):
    wall_s: float = 0.0
    ettr: float = 0.0
    buckets: Buckets = field(default_factory=Buckets)
    memory_snapshot_s: float = 0.0
    predicted: Prediction | None = None


# -- the rest of the run ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StorageCounts(Record):
    """One kind of storage request's counts (``storage.retry.OpStats``)."""

    calls: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    not_found: int = 0
    retry_wait_s: float = 0.0
    success_rate: float = 1.0


@dataclass(frozen=True, kw_only=True)
class ChaosSection(Record):
    kills: tuple[Kill, ...] = ()
    skipped: tuple[ChaosSkip, ...] = ()  # kill windows without a kill, and why
    injected: tuple[Injected, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CheckpointsSection(Record):
    committed: int = 0
    failed: int = 0
    latest: str | None = None  # the newest committed checkpoint: what a resume restores
    fallbacks: tuple[Fallback, ...] = ()  # checkpoints that did not verify, and where they went
    committed_while_stopping: int | None = optional()  # its step, committed as the run stopped


@dataclass(frozen=True, kw_only=True)
class DataSection(Record):
    """What the run's data held that is not a sample: files skipped as bad, once each, and
    where the batches were decoded."""

    skipped: int = 0
    skipped_files: tuple[SkippedFile, ...] = ()
    decode: DecodeChoice | None = None


@dataclass(frozen=True, kw_only=True)
class EpochAudit(Record):
    """One epoch's samples the final model was trained on (``trainer.audit_samples``)."""

    epoch: int
    resumed_at: int = 0
    trained: int = 0
    skipped: int = 0
    unique: int = 0
    duplicates: int = 0
    missing: int = 0
    unexpected: int = 0
    misplaced: int = 0  # steps that did not train the data order's global batch

    @property
    def exactly_once(self) -> bool:
        return not (self.duplicates or self.missing or self.unexpected or self.misplaced)


@dataclass(frozen=True, kw_only=True)
class Timing(Record):
    """Wall-clock times of the run's milestones (:func:`ftjob.reporting.summary.timing`)."""

    run_started: float | None = None  # the driver started: second 0 of goodput and timeline
    started: float | None = None  # the run ledger started (after the cluster)
    workers_started: float | None = None
    first_step: float | None = None
    first_step_took: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class AlreadyFinished(Record):
    """``resume=auto`` found the run finished: its last step's checkpoint."""

    step: int
    checkpoint: str


@dataclass(frozen=True, kw_only=True)
class RunSummary(Record):
    """summary.json."""

    name: str = ""
    status: RunStatus = RunStatus.failed
    error: str | None = None  # one line; None when it succeeded
    wall_time_s: float = 0.0
    # Every key of ftjob.metrics.METRIC_KEYS, always; null where not finite (ints stay ints).
    metrics: dict[str, int | float | None] = field(
        default_factory=dict, metadata={FIXED_KEYS: M.METRIC_KEYS}
    )
    progress: Progress | None = empty_when_none()
    history: tuple[HistoryPoint, ...] = ()  # progress points, each step's surviving version
    failures: tuple[FailureRecord, ...] = ()
    chaos: ChaosSection = field(default_factory=ChaosSection)
    checkpoints: CheckpointsSection = field(default_factory=CheckpointsSection)
    storage: dict[str, StorageCounts] = field(default_factory=dict)  # by kind, and "total"
    validation: tuple[ValidationResult, ...] = ()
    validation_replaced: int = 0
    attempts: int = 0
    hangs: tuple[Hang, ...] = ()
    stragglers: StragglerReport = field(default_factory=StragglerReport)
    section_timeouts: dict[str, SectionTimeout] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)  # the public config (redacted)
    data: DataSection = field(default_factory=DataSection)
    audit: tuple[EpochAudit, ...] | None = optional()  # with trainer.audit_samples
    audit_batches: tuple[tuple[int, str], ...] | None = optional()  # [step, batch digest]
    world_sizes: tuple[int | None, ...] = ()
    resizes: tuple[ResizeRecord, ...] = ()
    timing: Timing = field(default_factory=Timing)
    goodput: Goodput = field(default_factory=Goodput)
    resume_command: str | None = optional()  # a run that did not succeed, with a checkpoint
    already_finished: AlreadyFinished | None = optional()

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.succeeded

    def metric(self, key: str) -> float:
        """A metric's value for arithmetic (0 where missing or not finite)."""
        return M.finite(self.metrics.get(key))

    def document(self) -> dict[str, object]:
        """The JSON document summary.json holds: non-finite numbers written as null."""
        document: dict[str, object] = M.json_safe(self.to_json())
        return document
