"""``logger.*``: the experiment loggers the driver feeds from the run ledger (see
:mod:`ftjob.reporting.loggers`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import ClassVar

from ftjob.config.choices import Choice, coerce_choices
from ftjob.config.rules import require

# backend -> (module it needs, the extra that installs it). ``logger.backends`` is a list, and
# OmegaConf names a list's element (``logger.backends[0]``), not the key a user set, when it
# refuses one: the list stays plain strings, checked here with the package each one needs.
LOGGER_BACKENDS = {
    "csv": (None, None),
    "tensorboard": ("tensorboard", "pip install 'ftjob[tensorboard]'"),
    "mlflow": ("mlflow", "pip install 'ftjob[mlflow]'"),
    "wandb": ("wandb", "pip install 'ftjob[wandb]'"),
}


class WandbMode(Choice):
    """``logger.wandb_mode`` (null: ``WANDB_MODE``, else wandb's default)."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    """Experiment loggers, fed by the driver from the run ledger (see ftjob.reporting.loggers)."""

    _group: ClassVar[str] = "logger"
    backends: list[str] = field(default_factory=list)
    dir: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "ftjob"
    wandb_project: str = "ftjob"
    wandb_mode: WandbMode | None = None
    wandb_entity: str | None = None  # the team or user the project belongs to
    wandb_group: str | None = None  # runs shown together (a sweep, a series of runs)
    wandb_tags: list[str] = field(default_factory=list)
    wandb_notes: str | None = None
    wandb_job_type: str | None = None  # train, eval, ...: W&B groups runs by it
    wandb_system_stats: bool = True  # CPU, memory, GPU figures W&B samples on the driver
    # Points as the driver sees them, not once a checkpoint settles them: a step trained
    # again after a restore is then logged twice in W&B, MLflow and CSV (TensorBoard rewinds).
    live: bool = False

    def __post_init__(self) -> None:
        coerce_choices(self)
        for tag in self.wandb_tags:
            require(
                isinstance(tag, str) and 0 < len(tag) <= 64,
                self._group,
                "wandb_tags",
                self.wandb_tags,
                "each tag must be a word of 1 to 64 characters (W&B's limit)",
            )
        for key, most in (("wandb_group", 128), ("wandb_job_type", 64)):
            value = getattr(self, key)
            require(
                value is None or 0 < len(value) <= most,
                self._group,
                key,
                value,
                f"must be null or 1 to {most} characters (W&B's limit)",
            )
        for backend in self.backends:
            require(
                backend in LOGGER_BACKENDS,
                self._group,
                "backends",
                self.backends,
                f"each must be one of {sorted(LOGGER_BACKENDS)}",
            )
            module, extra = LOGGER_BACKENDS[backend]
            require(
                module is None or importlib.util.find_spec(module) is not None,
                self._group,
                "backends",
                self.backends,
                f"{backend} needs the {module} package: {extra}",
            )
