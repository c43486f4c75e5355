"""Experiment loggers (``logger`` group: csv, tensorboard, mlflow, wandb), written by the driver from
the run ledger -- never by a worker, so a killed worker never loses or duplicates a point.

A step's figures (training loss, throughput, learning rate; validation) can be trained again
after a restore. :class:`LogFeed` holds each step until it is *settled* -- at or before a
committed checkpoint, or the run is over -- and then logs the surviving version once: a
restore never draws a second curve. Events (kills, failures, restores, checkpoints, hangs,
preemptions: the ledger's progress lines other than step lines) are logged as they come; the
resolved config goes in as params, the summary at the end.

A resumed run continues the same W&B and MLflow runs: their ids are kept in the run's storage
beside its checkpoints (:data:`LOGGER_RUNS_FILE`, a :class:`LoggerRuns`), read back when the
run continues, and handed to ``wandb.init(id=..., resume="allow")`` and MLflow's client.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import posixpath
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from ftjob import record
from ftjob.config import LoggerConfig
from ftjob.metrics import TRAIN_STEPS_COMPLETED
from ftjob.reporting.run_summary import RunSummary
from ftjob.storage.checkpoint import CheckpointStore
from ftjob.text import shorten

LOGGER_RUNS_FILE = "loggers.json"  # under the run's directory in its storage

log = logging.getLogger("ftjob.reporting.loggers")

# Step and validation lines are metrics (logged once settled), not events.
METRIC_LINE = re.compile(r"^(epoch \d+/\d+ step \d+/\d+ |validation at step \d+: )")


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """``{"trainer.lr": "0.003", ...}``: a nested config as flat string params."""
    if isinstance(config, dict):
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(config) if isinstance(config, list) else str(config)}


class CsvLogger:
    def __init__(self, root: str, name: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self._metrics = open(os.path.join(root, "metrics.csv"), "w", newline="")
        self._events = open(os.path.join(root, "events.csv"), "w", newline="")
        self.metrics, self.events = csv.writer(self._metrics), csv.writer(self._events)
        self.metrics.writerow(["step", "name", "value"])
        self.events.writerow(["time", "step", "event"])

    def params(self, params: dict[str, str]) -> None:
        with open(os.path.join(self.root, "params.json"), "w") as f:
            json.dump(params, f, indent=1)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.metrics.writerow([step, name, value])
        self._metrics.flush()

    def event(self, when: float, step: int, text: str) -> None:
        self.events.writerow([f"{when:.3f}", step, text])
        self._events.flush()

    def finish(self, summary: RunSummary) -> None:
        self._metrics.close()
        self._events.close()


class TensorBoardLogger:
    def __init__(self, root: str, name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(root, "tensorboard", name))

    def params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def event(self, when: float, step: int, text: str) -> None:
        self.writer.add_text("events", text, step, walltime=when)

    def rewind(self, step: int) -> None:
        """``logger.live``: the points logged at ``step`` and after are stale (a restore went
        back): TensorBoard's reader drops the scalars there at a session start -- what
        ``SummaryWriter(purge_step=...)`` writes when a writer opens. (It keeps the text:
        the events placed there, the failure and the restore, are not stale.)"""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = Event(step=step, session_log=SessionLog(status=SessionLog.START))
        self.writer._get_file_writer().add_event(start)

    def finish(self, summary: RunSummary) -> None:
        step = int(summary.metric(TRAIN_STEPS_COMPLETED))
        for key, value in summary.metrics.items():
            if isinstance(value, (int, float)) and key.startswith(("goodput/", "recovery/")):
                self.writer.add_scalar(f"summary/{key}", value, step)
        self.writer.add_text("summary", f"status: {summary.status}", step)
        self.writer.close()


@dataclass(frozen=True)
class LoggerRuns(record.Record):
    """The loggers' own run ids, kept with the run so that a resume continues those runs."""

    wandb_id: str | None = record.optional()
    mlflow_run_id: str | None = record.optional()


def read_logger_runs(fs: Any, run_path: str) -> LoggerRuns:
    """The ids kept in ``run_path`` (none: a run's first start, or one without loggers)."""
    try:
        return LoggerRuns.from_json(
            json.loads(fs.cat_file(posixpath.join(run_path, LOGGER_RUNS_FILE)))
        )
    except FileNotFoundError:
        return LoggerRuns()


def keep_logger_runs(fs: Any, run_path: str, runs: LoggerRuns) -> None:
    fs.pipe_file(posixpath.join(run_path, LOGGER_RUNS_FILE), json.dumps(runs.to_json()).encode())


def runs_of(loggers: list[Any], before: LoggerRuns) -> LoggerRuns:
    """The ids of ``loggers``' runs (``before``'s where a backend is not used now)."""
    ids = {k: v for k, v in before.to_json().items() if isinstance(v, str)}
    for logger in loggers:
        ids.update(getattr(logger, "run_ids", {}))
    return LoggerRuns.from_json(ids)


class MlflowLogger:
    def __init__(
        self, config: LoggerConfig, run_dir: str, name: str, run_id: str | None = None
    ) -> None:
        from mlflow.tracking import MlflowClient

        store = os.path.join(os.path.abspath(run_dir), "mlruns")
        uri = config.mlflow_tracking_uri or f"file:{store}"
        if uri.startswith("file:"):  # MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(config.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(config.mlflow_experiment)
        )
        self.existing: dict[str, str] = {}  # a continued run's params
        self.run_id = self._continued(run_id) or (
            self.client.create_run(experiment_id, run_name=name).info.run_id
        )
        self.run_ids = {"mlflow_run_id": self.run_id}
        self.events: list[str] = []

    def _continued(self, run_id: str | None) -> str | None:
        """The run a resumed run logged to, running again -- if this tracking store has it
        (the default store is in the run dir of the driver that made it)."""
        from mlflow.exceptions import MlflowException

        if run_id is None:
            return None
        try:
            self.existing = self.client.get_run(run_id).data.params
        except MlflowException:
            log.warning("MLflow run %s is not in this tracking store: a new run is made", run_id)
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A continued run keeps the params it was started with (MLflow refuses to change one).
        kept = getattr(self, "existing", {})
        items = [Param(k[:250], v[:6000]) for k, v in sorted(params.items()) if k[:250] not in kept]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(1000 * time.time())
        metrics = [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, when: float, step: int, text: str) -> None:
        self.events.append(f"{when:.3f}\tstep {step}\t{text}")
        self.client.set_tag(self.run_id, f"event.{len(self.events):04d}", text[:5000])

    def finish(self, summary: RunSummary) -> None:
        self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "events.txt")
        self.client.log_dict(self.run_id, summary.document(), "summary.json")
        status = "FINISHED" if summary.ok else "FAILED"
        self.client.set_terminated(self.run_id, status)


class WandbLogger:
    """Weights & Biases. Metrics go against the training step as a metric of its own
    (``trainer/step``): wandb's own step may only grow, while the feed logs a step once it is
    settled, after events placed at later steps. Events become a table at the end, the summary
    the run's summary. No code, git state, command line or machine facts are sent (the
    command line can hold a secret); ``WANDB_MODE=offline`` or ``logger.wandb_mode=offline``
    writes the run under the run dir for ``wandb sync``."""

    STEP = "trainer/step"

    def __init__(
        self, config: LoggerConfig, run_dir: str, name: str, run_id: str | None = None
    ) -> None:
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(
            console="off",
            disable_code=True,
            disable_git=True,
            x_disable_meta=True,
            x_disable_stats=not config.wandb_system_stats,
            x_disable_machine_info=True,
            x_save_requirements=False,
            silent=True,
        )
        mode: Any = config.wandb_mode  # a word wandb knows (logger.wandb_mode's choices)
        self.run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            group=config.wandb_group,
            tags=list(config.wandb_tags) or None,
            notes=config.wandb_notes,
            job_type=config.wandb_job_type,
            name=name,
            # The run's id, kept with the run: a resumed run continues this W&B run. 64 random
            # bits: with resume="allow" two runs of a project that drew the same id would log
            # into one W&B run, said nowhere.
            id=run_id or secrets.token_hex(8),
            resume="allow",
            dir=os.path.abspath(run_dir),
            mode=mode,
            settings=settings,
        )
        self.run_ids = {"wandb_id": self.run.id}
        self.run.define_metric(self.STEP)
        self.run.define_metric("*", step_metric=self.STEP)
        self.events: list[list[Any]] = []

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        finite = {k: v for k, v in values.items() if math.isfinite(v)}
        self.run.log({self.STEP: step, **finite})

    def event(self, when: float, step: int, text: str) -> None:
        self.events.append([when, step, text])

    def finish(self, summary: RunSummary) -> None:
        metrics = summary.metrics
        self.run.summary.update(
            {f"summary/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        )
        self.run.summary["status"] = str(summary.status)
        table = self.wandb.Table(columns=["time", "step", "event"], data=self.events)
        self.run.log({"events": table})
        self.run.finish(exit_code=0 if summary.ok else 1)


def build_loggers(
    config: LoggerConfig,
    run_dir: str,
    name: str,
    runs: LoggerRuns | None = None,
    label: str | None = None,
) -> list[Any]:
    """The loggers of ``config.backends``; ``runs``: the W&B and MLflow runs a resumed run
    continues. In a ``logger.dir`` that runs share, each run's CSV and TensorBoard files lie
    in a folder named by ``label``, its identity (``<name>@<key>``: a name alone may be
    another run's, with other storage); under the run dir, by ``name``."""
    shared = config.dir is not None
    root = config.dir or os.path.join(run_dir, "logs")
    folder = (label or name) if shared else name
    runs = runs or LoggerRuns()
    made: dict[str, Any] = {
        "csv": lambda: CsvLogger(os.path.join(root, folder) if shared else root, name),
        "tensorboard": lambda: TensorBoardLogger(root, folder),
        "mlflow": lambda: MlflowLogger(config, run_dir, name, runs.mlflow_run_id),
        "wandb": lambda: WandbLogger(config, run_dir, name, runs.wandb_id),
    }
    loggers = []
    for backend in dict.fromkeys(config.backends):
        try:
            loggers.append(made[backend]())
        # A job boundary: a backend's client (an MLflow server that does not answer, a log
        # directory that cannot be written) raises its own error types; the run stops before
        # training with one line naming the backend.
        except Exception as exc:
            first = shorten((str(exc).strip().splitlines() or [""])[0], 300)
            raise LoggerError(
                f"logger.backends: {backend} could not start ({type(exc).__name__}: {first}); "
                "fix its settings (logger.*) or drop it from logger.backends"
            ) from exc
    return loggers


def continued_loggers(
    config: LoggerConfig,
    run_dir: str,
    name: str,
    storage: tuple[Any, str],
    continues: bool,
    warn: Any = log.warning,
    label: str | None = None,
) -> list[Any]:
    """:func:`build_loggers` for the run at ``storage`` (filesystem, the run's path): one that
    ``continues`` carries on the W&B and MLflow runs whose ids it kept there; the ids of the
    runs logged to now are kept there for the next resume. Storage that fails here is said
    (``warn``), and costs only that continuity."""
    fs, run_path = storage
    runs = LoggerRuns()
    if continues and config.backends:
        try:
            runs = read_logger_runs(fs, run_path)
        except (OSError, RuntimeError, ValueError) as exc:  # StorageError: retries spent
            warn(f"warning: the loggers' run ids could not be read ({exc}): new runs are made")
    loggers = build_loggers(config, run_dir, name, runs, label)
    kept = runs_of(loggers, runs)
    if kept != runs:
        try:
            keep_logger_runs(fs, run_path, kept)
        except (OSError, RuntimeError) as exc:
            warn(
                f"warning: the loggers' run ids could not be kept ({exc}): a resume makes new runs"
            )
    return loggers


class LoggerError(RuntimeError):
    """An experiment logger could not start; the message names the backend."""


class LogFeed:
    """Feeds the loggers from the ledger's step records and progress lines, each step once.

    ``live`` (``logger.live``): a step is logged as soon as the driver sees it, not once a
    checkpoint settles it. A step trained again after a restore is then logged again: a
    logger that can go back (TensorBoard: :meth:`TensorBoardLogger.rewind`) is rewound to
    the first step the new attempt trained; the others (W&B, MLflow, CSV) keep both."""

    def __init__(self, loggers: list[Any], live: bool = False) -> None:
        self.loggers = loggers
        self.live = live
        self.cursor = 0
        self.pending: dict[tuple[int, str], record.StepRecord] = {}  # (step, kind) -> newest
        self.step = 0  # the run's furthest step seen: events are placed there
        self.first_step: dict[int, int] = {}  # live: attempt -> the first step it trained
        self.logged: tuple[int, int] | None = None  # live: newest attempt and step logged

    def _each(self, method: str, *args: Any, only_able: bool = False) -> None:
        for logger in list(self.loggers):
            if only_able and not hasattr(logger, method):
                continue
            try:
                getattr(logger, method)(*args)
            # A job boundary: each backend is third-party code (MLflow, TensorBoard) raising
            # its own error types, and its failure must not end the training run. It is said
            # with its traceback (a bug shows as one) and that logger stops.
            except Exception as exc:
                name = type(logger).__name__
                log.warning(
                    "%s stopped logging: %s: %s", name, type(exc).__name__, exc, exc_info=True
                )
                self.loggers.remove(logger)

    def params(self, config: dict[str, Any]) -> None:
        self._each("params", flatten(config))

    def records(self, feed: record.LogFeed) -> None:
        """``feed``: the ledger's :meth:`~ftjob.driver.ledger.RunLedger.log_feed` since the cursor."""
        self.cursor = feed.cursor
        for point in feed.records:
            first = self.first_step.setdefault(point.attempt, point.step)
            self.first_step[point.attempt] = min(first, point.step)
            key = (point.step, point.kind)
            if key not in self.pending or point.attempt >= self.pending[key].attempt:
                self.pending[key] = point  # a step trained again replaces its earlier version
            self.step = max(self.step, point.step)
        self._flush(math.inf if self.live else feed.settled)

    def _stale(self, point: record.StepRecord) -> bool:
        """A dying attempt's step that a later attempt went back before (live only: settled
        steps are never stale)."""
        return any(a > point.attempt and s <= point.step for a, s in self.first_step.items())

    def _flush(self, settled: float) -> None:
        for key in sorted(k for k in self.pending if k[0] <= settled):
            point = self.pending.pop(key)
            if self.live and self._stale(point):
                continue
            if self.live and (
                self.logged is None
                or (point.attempt > self.logged[0] and point.step <= self.logged[1])
            ):
                # The first point this driver logs (a resumed run's earlier driver may have
                # logged past it), or the first of an attempt that went back.
                self._each_that_can("rewind", point.step)
            values = {f"{point.kind}/{k}": v for k, v in point.values.items()}
            self._each("scalars", point.step, values)
            if self.live:
                attempt, step = self.logged or (point.attempt, point.step)
                self.logged = (max(attempt, point.attempt), max(step, point.step))

    def _each_that_can(self, method: str, *args: Any) -> None:
        self._each(method, *args, only_able=True)

    def events(self, lines: list[str], when: float) -> None:
        for line in lines:
            if not METRIC_LINE.match(line):
                self._each("event", when, self.step, line)

    def finish(self, summary: RunSummary) -> None:
        """The run is over. A run that succeeded (or stopped without a checkpoint: nothing can
        continue it) logs every step still held, the surviving version. One that stopped
        logs those at or before its latest committed checkpoint: a resume trains the rest
        again, and logs them then, in the W&B and MLflow runs this one continues."""
        settled = math.inf
        latest = summary.checkpoints.latest
        if not summary.ok and latest is not None:
            step = CheckpointStore.step_of(latest)
            settled = math.inf if step is None else step
        self._flush(settled)
        self._each("finish", summary)
