"""Composing configs the way ``python -m ftjob`` does, and reading overrides and sweeps.

One place for what the command line, ``python -m ftjob.check`` and the sweep report all need:
a :class:`Composer` over ftjob's packaged conf (plus a user's ``--config-dir``), the key an
override sets (:func:`override_key`), and the values a sweep runs (:func:`sweep_values`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.types import RunMode
from omegaconf import DictConfig

CONFIG_MODULE = "ftjob.conf"


def expose_hydra_plugins() -> None:
    """Let Hydra's plugin scan find ftjob's launcher (``hydra_plugins.ftjob_launcher``) also in
    an editable install, whose import hook hides the namespace package from ``pkgutil``."""
    import importlib.util

    try:
        import hydra_plugins

        spec = importlib.util.find_spec("hydra_plugins.ftjob_launcher")
    except ImportError:
        return
    if spec is None or not spec.submodule_search_locations:
        return
    root = os.path.dirname(next(iter(spec.submodule_search_locations)))
    if root not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(root)


PRIMARY_CONFIG = "config"
JOB, SWEEP = "job", "sweep"


@dataclass(frozen=True)
class Target:
    """One config file to compose (and check), and how."""

    label: str  # the file as reported, e.g. "experiment/digits_ft.yaml"
    overrides: tuple[str, ...] = ()
    config_name: str = PRIMARY_CONFIG
    # JOB: the whole job is validated (primary configs, experiments, `@package _global_`
    # options). SWEEP: the whole job, once per combination of swept values. Otherwise the key
    # of the group's node: a group option is validated on its own, because an option may be
    # valid only with others (chaos=node_killer needs a multi-node ray.*).
    scope: str = JOB
    group: str = ""  # the config group of an option file ("" for a primary config)
    user_primary: bool = False  # a primary config in the user's config dir


class Composer:
    """Composes configs from ftjob's conf plus an optional user config dir, searched after
    ftjob's conf as ``python -m ftjob --config-dir DIR`` does. A primary config that lives in
    the user's dir is composed from that dir, with ftjob's conf added to its search path
    (Hydra looks primary configs up before it applies ``hydra.searchpath``)."""

    def __init__(self, config_dir: str | None = None) -> None:
        self.config_dir = os.path.abspath(config_dir) if config_dir else None

    def _context(self, target: Target) -> tuple[Any, list[str]]:
        """Hydra's initialize context for ``target`` and the search-path override it needs."""
        expose_hydra_plugins()
        Plugins.instance()  # plugins' config groups (hydra/launcher=ftjob), as hydra.main sees them
        GlobalHydra.instance().clear()
        if target.user_primary and self.config_dir:
            context: Any = initialize_config_dir(config_dir=self.config_dir, version_base="1.3")
            return context, [f"hydra.searchpath=[pkg://{CONFIG_MODULE}]"]
        context = initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3")
        return context, [f"hydra.searchpath=[file://{self.config_dir}]"] if self.config_dir else []

    def compose(self, target: Target, overrides: Sequence[str], hydra: bool = False) -> DictConfig:
        context, search = self._context(target)
        with context:
            given = self._spell([*target.overrides, *overrides], target, search)
            return compose(
                config_name=target.config_name,
                overrides=[*given, *search],
                return_hydra_config=hydra,
            )

    def spelled(self, overrides: Sequence[str], target: Target | None = None) -> list[str]:
        """``overrides`` as Hydra takes them for ``target``'s primary config (:func:`spell_groups`)."""
        target = target or Target(PRIMARY_CONFIG)
        context, search = self._context(target)
        with context:
            return self._spell(overrides, target, search)

    def _spell(self, overrides: Sequence[str], target: Target, search: list[str]) -> list[str]:
        """:func:`spell_groups` against the groups in the primary config's defaults list (a
        null default, experiment, too), read only when an override adds something
        (``+key=...``): reading it costs about half a composition. ftjob's own primary
        configs are read once a process (a user's may change between calls)."""
        if not any(_adds(override) for override in overrides):
            return list(overrides)
        if target.user_primary:
            groups = _default_groups(target.config_name, tuple(search))
        else:
            groups = _packaged_default_groups(target.config_name)
        return spell_groups(overrides, groups)

    def group_options(self, group: str, target: Target | None = None) -> list[str]:
        """The options of ``group`` that exist (ftjob's conf plus the user's config dir)."""
        target = target or Target(PRIMARY_CONFIG)
        context, search = self._context(target)
        with context:
            loader = GlobalHydra.instance().config_loader()
            return sorted(
                loader.get_group_options(group, config_name=target.config_name, overrides=search)
            )

    def default_groups(self) -> set[str]:
        choices = self.compose(Target(PRIMARY_CONFIG), (), hydra=True).hydra.runtime.choices
        return {group for group in choices if not str(group).startswith("hydra/")}


def _default_groups(config_name: str, search: tuple[str, ...]) -> frozenset[str]:
    """The groups of the defaults list of ``config_name`` (Hydra initialised)."""
    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(search), RunMode.RUN)
    return frozenset(defaults.overrides.known_choices)


@functools.lru_cache(maxsize=8)
def _packaged_default_groups(config_name: str) -> frozenset[str]:
    """:func:`_default_groups` of one of ftjob's own primary configs (they do not change
    while a process runs; a user's config dir may add options, never groups to its defaults)."""
    return _default_groups(config_name, ())


def spell_groups(overrides: Sequence[str], defaults: Set[str]) -> list[str]:
    """``+group=option`` as ``group=option`` for a group already in the defaults list:
    ``+experiment=NAME`` (how an experiment was added before ``experiment`` had a null default)
    and ``experiment=NAME`` then both choose it, where Hydra refuses the first ("Multiple
    values for experiment")."""
    return [o[1:] if _adds(o) and override_key(o) in defaults else o for o in overrides]


def _adds(override: str) -> bool:
    """``+key=value``: adds a key or a group (``++`` forces a key, and is left alone)."""
    return "=" in override and override.startswith("+") and not override.startswith("++")


def override_key(override: str) -> str:
    """The key an override sets: ``+sweep=x``, ``++a.b=1``, ``~c`` set ``sweep``, ``a.b``, ``c``."""
    return override.split("=", 1)[0].lstrip("+~")


def parse_overrides(lines: Sequence[str]) -> dict[str, str]:
    """``key=value`` lines (e.g. of .hydra/overrides.yaml) as {key: value}, in their order."""
    parsed: dict[str, str] = {}
    for line in lines:
        text = str(line)
        parsed[override_key(text)] = text.split("=", 1)[1] if "=" in text else ""
    return parsed


@dataclass
class SweepValues:
    """What a sweep runs, per key (keys as :func:`override_key` gives them, in order)."""

    # key -> one override per value; a key set to one value has a list of one
    values: dict[str, list[str]] = field(default_factory=dict)
    # key -> its override, for sweeps that cannot be listed (``interval(0,1)`` for an
    # optimizing sweeper): they keep their config value wherever values are enumerated
    unlisted: dict[str, str] = field(default_factory=dict)

    @property
    def swept(self) -> list[str]:
        """Keys that take more than one value."""
        listed = [key for key, values in self.values.items() if len(values) > 1]
        return listed + list(self.unlisted)


def sweep_values(params: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> SweepValues:
    """The values of a sweep: a preset's ``hydra.sweeper.params`` first, then command-line
    overrides, whose value for a key replaces the preset's (as Hydra's BasicSweeper does)."""
    requested = [f"{key}={value}" for key, value in (params or {}).items()] + list(overrides)
    result = SweepValues()
    parsed = OverridesParser.create().parse_overrides(requested)
    for line, o in zip(requested, parsed, strict=True):  # an override's own line, as typed
        element = o.get_key_element()
        key = override_key(element)
        if o.is_discrete_sweep():
            result.unlisted.pop(key, None)
            result.values[key] = [f"{element}={v}" for v in o.sweep_string_iterator()]
        elif o.is_sweep_override():
            result.values.pop(key, None)
            result.unlisted[key] = line
        else:
            result.unlisted.pop(key, None)
            result.values[key] = [line]
    return result
