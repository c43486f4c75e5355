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

    def __post_init__(self) -> None:
        coerce_choices(self)
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
