"""summary.json's schema, generated from its types (:class:`RunSummary` and the records it is
made of): every key path it may hold, whether a document holds it always, and a check of a
document against them.

A path is written as readers reach it: ``.failures[].notice.deadline``; ``.storage.*`` where
the keys are the run's own (kinds of storage request, section names, a rank's number, the
config's groups). A path is *always there* where its parent is, unless it is an optional part
(left out while unset), a flattened part (a failure's recovery), one of a union's records (a
failure's origin: a kill's target, a hang, a straggler, an injected step) or under free keys.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterator
from typing import Any, Union

from ftjob.record import Record, field_types, json_keys, record_type
from ftjob.reporting.run_summary import FIXED_KEYS, RunSummary

Schema = dict[str, bool]  # key path -> always there (where its parent is)


def summary_schema() -> Schema:
    """Every key path of summary.json, generated from :class:`RunSummary`."""
    return record_schema(RunSummary)


def record_schema(cls: type[Record], path: str = "", always: bool = True) -> Schema:
    schema: Schema = {}
    for f, hint, key in _json_fields(cls):
        if f.metadata.get("flatten"):
            schema.update(record_schema(record_type(hint), path, False))
            continue
        here = f"{path}.{key}"
        there = always and not f.metadata.get("omit_none")
        schema[here] = there
        keys = f.metadata.get(FIXED_KEYS)
        if keys is not None:
            schema.update({f"{here}.{k}": there for k in keys})
        else:
            schema.update(_type_schema(hint, here, there))
    return schema


def _json_fields(cls: type[Record]) -> Iterator[tuple[dataclasses.Field[Any], Any, str]]:
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name], f.metadata.get("key", f.name)


def _members(hint: Any) -> list[Any]:
    """A type's alternatives, None left out."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Record)


def _type_schema(hint: Any, path: str, always: bool) -> Schema:
    members = _members(hint)
    always = always and type(None) not in typing.get_args(hint)  # null: nothing under it
    records = [m for m in members if _is_record(m)]
    if records:
        schema: Schema = {}
        for cls in records:  # one of several: none is always there
            for sub, there in record_schema(cls, path, always and len(records) == 1).items():
                schema[sub] = schema.get(sub, False) or there
        return schema
    if len(members) > 1:
        return {}  # a number: int | float
    kind = members[0]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is dict:
        return {f"{path}.*": False, **_type_schema(args[1], f"{path}.*", False)}
    if origin in (tuple, list) and (len(args) == 2 and args[1] is Ellipsis or origin is list):
        return _type_schema(args[0], f"{path}[]", False)
    return {}  # a value: a number, a string, a choice, a fixed tuple ([step, digest])


# -- a document against the types ------------------------------------------------------------


def check_summary(document: object) -> tuple[set[str], list[str]]:
    """The schema paths a summary.json document holds, and what in it the types refuse: a key
    no type has, a key that must be there and is not, a value of another type."""
    found: set[str] = set()
    problems: list[str] = []
    _check(RunSummary, document, "", found, problems)
    return found, problems


def _check(hint: Any, value: object, path: str, found: set[str], problems: list[str]) -> None:
    members = _members(hint)
    if value is None:
        # Allowed where the type says so, and for any number: a non-finite one is null.
        if type(None) not in typing.get_args(hint) and not {float, object} & set(members):
            problems.append(f"{path or '.'}: null, not {hint}")
        return
    records = [m for m in members if _is_record(m)]
    if records:
        tries = []
        for cls in records:
            tried: tuple[set[str], list[str]] = (set(), [])
            _check_record(cls, value, path, *tried)
            tries.append(tried)
        best = min(tries, key=lambda t: len(t[1]))
        found |= best[0]
        problems += best[1]
        return
    if len(members) > 1:  # numbers: int | float
        members = [float] if set(members) <= {int, float} else members
    _check_value(members[0], value, path, found, problems)


def _check_record(
    cls: type[Record], value: object, path: str, found: set[str], problems: list[str]
) -> None:
    if not isinstance(value, dict):
        problems.append(f"{path or '.'}: {type(value).__name__}, not an object ({cls.__name__})")
        return
    known: set[str] = set()
    for f, hint, key in _json_fields(cls):
        if f.metadata.get("flatten"):
            part = record_type(hint)
            keys = json_keys(part)
            known.update(keys)
            if any(k in value for k in keys):
                _check_record(
                    part, {k: value[k] for k in keys if k in value}, path, found, problems
                )
            continue
        known.add(key)
        here = f"{path}.{key}"
        if key not in value:
            if not f.metadata.get("omit_none"):
                problems.append(f"{here}: missing")
            continue
        found.add(here)
        if f.metadata.get("empty_when_none") and value[key] == {}:
            continue  # None, written as {}
        fixed = f.metadata.get(FIXED_KEYS)
        if fixed is not None:
            _check_fixed(hint, value[key], here, fixed, found, problems)
        else:
            _check(hint, value[key], here, found, problems)
    problems += [f"{path}.{k}: no such key in {cls.__name__}" for k in value if k not in known]


def _check_fixed(
    hint: Any,
    value: object,
    path: str,
    keys: tuple[str, ...],
    found: set[str],
    problems: list[str],
) -> None:
    if not isinstance(value, dict):
        problems.append(f"{path}: not an object")
        return
    problems += [f"{path}.{k}: missing" for k in keys if k not in value]
    problems += [f"{path}.{k}: no such key" for k in value if k not in keys]
    item = typing.get_args(hint)[1]
    for k, v in value.items():
        if k in keys:
            found.add(f"{path}.{k}")
            _check(item, v, f"{path}.{k}", found, problems)


def _check_value(kind: Any, value: object, path: str, found: set[str], problems: list[str]) -> None:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any or kind is object:
        return
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: not an object")
            return
        for v in value.values():
            found.add(f"{path}.*")
            _check(args[1], v, f"{path}.*", found, problems)
        return
    if origin in (tuple, list):
        if not isinstance(value, list):
            problems.append(f"{path}: not a list")
        elif origin is list or (len(args) == 2 and args[1] is Ellipsis):
            for v in value:
                _check(args[0], v, f"{path}[]", found, problems)
        elif len(value) != len(args):
            problems.append(f"{path}: {len(value)} items, not {len(args)}")
        return
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        if value not in {m.value for m in kind}:
            problems.append(f"{path}: {value!r} is no {kind.__name__}")
        return
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(kind, True)
    if not ok:
        problems.append(f"{path}: {value!r} is not {getattr(kind, '__name__', kind)}")
