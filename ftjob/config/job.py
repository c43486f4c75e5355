"""The whole job (:class:`JobConfig`): every group's config, and the rules that span groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, BooleanNode
from omegaconf.errors import ValidationError

from ftjob.config.backends import check_backend, fsspec_protocol
from ftjob.config.chaos import NODE_KINDS, ChaosConfig, ChaosKind
from ftjob.config.checkpoint import CheckpointConfig
from ftjob.config.cluster import RayConfig
from ftjob.config.failure import FailureConfig
from ftjob.config.logger import LoggerConfig
from ftjob.config.names import validate_run_name
from ftjob.config.rules import ConfigError, is_placeholder, refuse_non_finite, require
from ftjob.config.trainer import TrainerConfig

RESUME_AUTO = (
    "auto"  # resume=auto: continue the run if it has a committed checkpoint, else start it
)


def resume_value(value: Any) -> bool | str:
    """``resume`` as the job holds it: a bool, read as OmegaConf reads one (``resume=true`` on
    the command line, ``resume: yes`` in YAML), or the word ``auto``; anything else is refused
    with the words the key takes."""
    if isinstance(value, str) and value == RESUME_AUTO:
        return RESUME_AUTO
    try:
        read = None if value is None else BooleanNode(value=value)._value()
    except ValidationError:
        read = None
    if not isinstance(read, bool):
        raise ConfigError(
            "resume",
            value,
            "must be false (start a new run), true (continue the run called `name`) or auto "
            "(continue it if it has a committed checkpoint, start it otherwise)",
        )
    return read


@dataclass
class JobConfig:
    """The whole job. ``model``, ``dataset`` and ``optimizer`` are ``_target_`` nodes: the
    dataset is built on the driver, the model and optimizer in each worker (the model with the
    dataset's ``num_classes``, the optimizer as a partial called with the model's parameters
    and ``trainer.lr``). Their targets are imported and checked by
    :func:`ftjob.config.targets.check_job_targets` when the job is loaded, not here."""

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
    # false, true or auto. OmegaConf 2.3 types no union of a bool and a word, so this key is
    # checked here (resume_value).
    resume: Any = False

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        self.resume = resume_value(self.resume)
        require(
            self.resume is False or bool(self.name),
            "",
            "resume",
            self.resume,
            "resume=auto continues the run called `name` when its storage holds a committed "
            "checkpoint, and starts it otherwise: set name=RUN_NAME too, a name that stays the "
            "same when a scheduler reruns the job"
            if self.resume == RESUME_AUTO
            else "resume=true continues the run called `name`: set name=RUN_NAME too",
        )
        validate_run_name(self.name)
        self._check_chaos_has_what_it_needs()
        require(
            self.trainer.checkpoint_every_n_steps != "auto" or bool(self.failure.expected_mtbf_s),
            "failure",
            "expected_mtbf_s",
            self.failure.expected_mtbf_s,
            "trainer.checkpoint_every_n_steps=auto picks the interval for a failure rate: declare "
            "it, e.g. failure.expected_mtbf_s=3600 (seconds between failures you expect)",
        )
        self._check_storage_on_cluster()
        self._check_storage_backends()
        self._check_node_chaos_may_break_the_cluster()

    def _check_chaos_has_what_it_needs(self) -> None:
        """Node chaos needs nodes to take away; a hang needs hang detection to end it."""
        chaos = self.chaos
        if chaos.takes_nodes():
            node_kinds = [k.value for k in chaos.kinds() if k in NODE_KINDS]
            require(
                self.ray.local_nodes > 1 or self.ray.address is not None,
                "chaos",
                "kind",
                chaos.kind,
                f"{'/'.join(node_kinds)} chaos takes nodes away: it needs a multi-node cluster: "
                "set ray.local_nodes=3 (simulated) or ray.address",
            )
        require(
            self.ray.replace_after_steps is None or self.trainer.elastic,
            "ray",
            "replace_after_steps",
            self.ray.replace_after_steps,
            "a killed node comes back once the workers left without it trained that many "
            "steps, and a fixed-size group trains none without it (it waits for the node): "
            "set trainer.min_workers below trainer.num_workers, or ray.replace_after_steps=null",
        )
        require(
            ChaosKind.hang not in chaos.kinds() or not chaos.enabled or self.failure.hang.enabled,
            "failure.hang",
            "enabled",
            self.failure.hang.enabled,
            "a hang (chaos.kind=hang, or in chaos.mix) stops a worker that nothing resumes: "
            "only hang detection ends it; set failure.hang.enabled=true",
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

    def _check_storage_backends(self) -> None:
        """The fsspec backends of the checkpoint and dataset URLs are installed."""
        if self.checkpoint.storage_path:
            check_backend(self.checkpoint.storage_path, "checkpoint.storage_path")
        dataset_path = self.dataset.get("path")
        if isinstance(dataset_path, str) and not is_placeholder(dataset_path):
            check_backend(dataset_path, "dataset.path")

    def _check_node_chaos_may_break_the_cluster(self) -> None:
        """Node and preempt kills take raylets down with every tenant's work on them: on a
        cluster ftjob did not start, only with an explicit opt-in."""
        if not self.chaos.takes_nodes():
            return
        require(
            self.ray.address is None or self.chaos.allow_on_existing_cluster,
            "chaos",
            "allow_on_existing_cluster",
            self.chaos.allow_on_existing_cluster,
            f"chaos.kind={self.chaos.kind} ({'/'.join(k.value for k in self.chaos.kinds())}) "
            "SIGKILLs raylets of the cluster at "
            f"ray.address={self.ray.address!r}, and every other job's work on those nodes "
            "with them: set chaos.allow_on_existing_cluster=true if this cluster is yours "
            "to break (or test on a simulated one: drop ray.address, set ray.local_nodes=3)",
        )
