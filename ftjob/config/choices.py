"""Keys that take one of a few words, typed as str Enums.

A schema key typed with a :class:`Choice` is checked by OmegaConf wherever Hydra merges a config
file or an override into the schema: any other word is refused at composition, before the job
is loaded, naming the key, the value and the words it takes. OmegaConf reads a YAML value as a
member's *name*, so every member is named as its value (``ChaosKind.node == "node"``).

A member is its word: it compares and hashes equal to the plain string, and formats
(``str``, f-strings, ``%s``), shows in messages (``repr``) and dumps to JSON as that word, so
code elsewhere compares with plain strings, and what ftjob writes holds plain strings.
"""

from __future__ import annotations

import functools
import types
import typing
from enum import Enum
from typing import Any

from ftjob.config.rules import ConfigError


class Choice(str, Enum):
    """The words one key takes (subclass it, one member per word, named as its value)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    def __repr__(self) -> str:
        return str.__repr__(self)

    @classmethod
    def words(cls) -> list[str]:
        return [member.value for member in cls]


def coerce_choices(config: Any) -> None:
    """The choice keys of a group's dataclass as members: a config built in Python (not
    composed by Hydra, which has converted them already) may hold plain strings; a word the key
    does not take is refused, naming the key, the value and the words."""
    schema: type = type(config)  # mypy takes type[Any] for unhashable, a class for hashable
    for name, (choice, nullable) in _choice_keys(schema).items():
        value = getattr(config, name)
        if isinstance(value, choice) or (value is None and nullable):
            continue
        if isinstance(value, str) and value in choice.words():
            setattr(config, name, choice(value))
            continue
        words = f"must be one of {choice.words()}" + (", or null" if nullable else "")
        raise ConfigError(f"{config._group}.{name}", value, words)


@functools.cache
def _choice_keys(schema: type) -> dict[str, tuple[type[Choice], bool]]:
    """``key -> (its Choice, whether it takes null)`` for the keys of ``schema`` typed so."""
    found = {}
    for name, hint in typing.get_type_hints(schema).items():
        nullable = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = [a for a in typing.get_args(hint) if a is not type(None)] if nullable else [hint]
        if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], Choice):
            found[name] = (kinds[0], nullable and type(None) in typing.get_args(hint))
    return found
