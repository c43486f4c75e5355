"""``--cfg job|hydra|all``: the composed config, printed as Hydra prints it -- once it is
checked, without its secrets, and without the keys only earlier spellings fill.

Hydra's own ``--cfg`` prints the config as composed: storage options, header pairs and the
workers' environment in the clear, a dozen null aliases under ``failure:``, and an invalid
config as Hydra's raw error. ftjob checks the config as a run would (the same one-line error
and exit 2), then prints it redacted (:mod:`ftjob.config.secrets`) with Hydra's layout:
``--package``/``-p`` selects a node, ``--resolve`` resolves interpolations first.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ftjob.config import ConfigError
from ftjob.config.legacy import without_renamed_keys
from ftjob.config.secrets import Redactor, redactor_for

# What --cfg may print (Hydra's choices).
KINDS = ("job", "hydra", "all")
# Hydra's own help texts: not config a user set (Hydra leaves them out of --cfg hydra too).
_HYDRA_HELP = ("help", "hydra_help")


def config_text(
    cfg: DictConfig, kind: str, package: str | None, resolve: bool, given: Redactor
) -> tuple[str, int]:
    """What ``--cfg kind`` prints for ``cfg`` (composed with its ``hydra`` node), and the exit
    code. ``given``: the command line's secrets. Raises ConfigError for an interpolation that
    does not resolve (``--resolve``)."""
    HydraConfig.instance().set_config(cfg)  # ${hydra:...} resolves as in the run
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]
    redactor = redactor_for(job, cfg.hydra.job.env_set).joined(given)
    try:
        plain = OmegaConf.to_container(job, resolve=resolve)
        hydra = OmegaConf.to_container(cfg.hydra, resolve=resolve) if kind != "job" else {}
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError(key, None, f"does not resolve: {str(exc).splitlines()[0]}") from None
    shown: dict[str, Any] = {}
    if kind in ("hydra", "all") and isinstance(hydra, dict):
        readable = {k: v for k, v in hydra.items() if k not in _HYDRA_HELP}
        shown["hydra"] = redactor.hydra(readable)
    if kind in ("job", "all") and isinstance(plain, dict):
        shown.update(without_renamed_keys(redactor.config(plain)))
    return _selected(shown, package)


def _selected(shown: dict[str, Any], package: str | None) -> tuple[str, int]:
    """The whole config, or the node ``package`` names (``_global_``: the whole)."""
    if package in (None, "_global_"):
        return OmegaConf.to_yaml(OmegaConf.create(shown)), 0
    node = OmegaConf.select(OmegaConf.create(shown), package)
    if node is None:
        print(f"package '{package}' not found in config", file=sys.stderr)
        return "", 1
    if not isinstance(node, DictConfig) and not OmegaConf.is_list(node):
        return f"{node}\n", 0
    return f"# @package {package}\n{OmegaConf.to_yaml(node)}", 0
