"""The job schema: one typed dataclass per config group, validated once before Ray starts.

Hydra composes conf/ against these dataclasses (registered in the ConfigStore as
``ftjob_schema``), so an unknown key, a wrong type or a word a choice key does not take is
refused at composition. Value rules live in each dataclass's ``__post_init__`` and raise
:class:`ConfigError`, whose message names the full key, the value and the rule.

Modules, each importing only those above it in this list:

- :mod:`~ftjob.config.rules`: ConfigError, JobError and the helpers every rule is phrased with
- :mod:`~ftjob.config.choices`: :class:`Choice`, the str Enum a choice key is typed with
- :mod:`~ftjob.config.legacy`: keys spelled the way earlier versions did
- :mod:`~ftjob.config.names`: what a run name may be
- :mod:`~ftjob.config.backends`: which fsspec backend a storage URL needs, and is it installed
- the groups: :mod:`~ftjob.config.checkpoint`, :mod:`~ftjob.config.chaos`,
  :mod:`~ftjob.config.failure`, :mod:`~ftjob.config.trainer`, :mod:`~ftjob.config.cluster`
  (``ray``), :mod:`~ftjob.config.logger`
- :mod:`~ftjob.config.job`: JobConfig, the whole job and the rules that span groups
- :mod:`~ftjob.config.targets`: ``_target_`` nodes imported and bound to their signatures
- :mod:`~ftjob.config.load`: load_job (composed config -> JobConfig), to_plain, plain_mapping,
  register_schema

This module re-exports the names the rest of the package uses.
"""

from ftjob.config.backends import INSTALL_HINTS, check_backend, fsspec_protocol
from ftjob.config.chaos import (
    ENDS_ATTEMPT,
    NODE_KINDS,
    STORAGE_ERRORS,
    WORKER_KINDS,
    ChaosConfig,
    ChaosKind,
    StorageChaosConfig,
)
from ftjob.config.checkpoint import (
    CheckpointConfig,
    MemoryConfig,
    RetryConfig,
    UploadMode,
    check_error_rules,
)
from ftjob.config.choices import Choice
from ftjob.config.cluster import RayConfig
from ftjob.config.failure import (
    FailureConfig,
    HangConfig,
    RestartLoopConfig,
    StragglerAction,
    StragglerConfig,
)
from ftjob.config.job import RESUME_AUTO, JobConfig, resume_value
from ftjob.config.legacy import RENAMED_FAILURE_KEYS, say_deprecated
from ftjob.config.load import load_job, plain_mapping, register_schema, to_plain
from ftjob.config.logger import LOGGER_BACKENDS, LoggerConfig, WandbMode
from ftjob.config.names import RUN_NAME, validate_run_name
from ftjob.config.rules import ConfigError, JobError, refuse_non_finite
from ftjob.config.targets import (
    TARGET_GROUPS,
    check_group_target,
    check_job_targets,
    check_target,
    import_target,
)
from ftjob.config.trainer import DecodePlace, LrSchedule, Placement, Precision, TrainerConfig

__all__ = [
    "ENDS_ATTEMPT",
    "INSTALL_HINTS",
    "LOGGER_BACKENDS",
    "NODE_KINDS",
    "RENAMED_FAILURE_KEYS",
    "RESUME_AUTO",
    "RUN_NAME",
    "STORAGE_ERRORS",
    "TARGET_GROUPS",
    "WORKER_KINDS",
    "ChaosConfig",
    "ChaosKind",
    "CheckpointConfig",
    "Choice",
    "ConfigError",
    "DecodePlace",
    "FailureConfig",
    "HangConfig",
    "JobConfig",
    "JobError",
    "LoggerConfig",
    "LrSchedule",
    "MemoryConfig",
    "Placement",
    "Precision",
    "RayConfig",
    "RestartLoopConfig",
    "RetryConfig",
    "StorageChaosConfig",
    "StragglerAction",
    "StragglerConfig",
    "TrainerConfig",
    "UploadMode",
    "WandbMode",
    "check_backend",
    "check_error_rules",
    "check_group_target",
    "check_job_targets",
    "check_target",
    "fsspec_protocol",
    "import_target",
    "load_job",
    "refuse_non_finite",
    "register_schema",
    "resume_value",
    "say_deprecated",
    "plain_mapping",
    "to_plain",
    "validate_run_name",
]
