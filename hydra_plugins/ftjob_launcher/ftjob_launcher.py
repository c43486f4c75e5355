"""Registers ``hydra/launcher=ftjob``; Hydra only instantiates launchers from ``hydra_plugins``.
(No ``from __future__ import annotations``: Hydra's plugin scan loads this module outside
``sys.modules``, where a dataclass cannot resolve string annotations.)"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from ftjob.cli.launcher import SweepLauncher


@dataclass
class FtjobLauncherConf:
    _target_: str = "hydra_plugins.ftjob_launcher.ftjob_launcher.FtjobLauncher"
    max_concurrent: int = 2  # sweep jobs running at once, each a full ftjob run
    resume: bool = False  # skip finished jobs, resume those with checkpoints, run the rest


class FtjobLauncher(SweepLauncher):
    pass


ConfigStore.instance().store(
    group="hydra/launcher", name="ftjob", node=FtjobLauncherConf, provider="ftjob"
)
