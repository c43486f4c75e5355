"""The run record: typed records in and out of the run ledger, each with one JSON form."""

from __future__ import annotations

import collections.abc
import dataclasses
import importlib
import inspect
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

import pytest

from ftjob import record
from ftjob.driver.ledger import RunLedger
from ftjob.record import (
    Attempt,
    Beat,
    ChaosSkip,
    CheckpointRecord,
    Fallback,
    FirstStep,
    Hang,
    JitCheckpoint,
    Kill,
    KillTarget,
    Notice,
    NoticeSource,
    Restore,
    RunPlan,
    RunSnapshot,
    Tier,
    WorkerLedger,
    WorkerPlace,
)

# Ray actor handles, by rank: what Ray Train hands the drain relay (ftjob.driver.drains).
OPAQUE = {("watch_drains", "actors")}


def _public_methods(cls: type) -> list[str]:
    return [n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]


def _mentions_any(hint: Any) -> bool:
    if hint is Any:
        return True
    return any(_mentions_any(arg) for arg in typing.get_args(hint))


def test_no_untyped_data_crosses_the_ledgers_boundary_in_either_direction():
    untyped = []
    for name in _public_methods(RunLedger):
        for param, hint in typing.get_type_hints(getattr(RunLedger, name)).items():
            if (name, param) not in OPAQUE and _mentions_any(hint):
                untyped.append(f"RunLedger.{name}({param}: {hint})")
    for cls in vars(record).values():
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(cls):
                if _mentions_any(hints[field.name]):
                    untyped.append(f"{cls.__name__}.{field.name}: {hints[field.name]}")
    assert not untyped, untyped


def test_the_ledger_takes_every_call_a_worker_makes_with_its_signature():
    for name in _public_methods(WorkerLedger):
        ours, theirs = getattr(RunLedger, name), getattr(WorkerLedger, name)
        assert inspect.signature(ours) == inspect.signature(theirs), name
        assert typing.get_type_hints(ours) == typing.get_type_hints(theirs), name


def _rich_snapshot() -> RunSnapshot:
    place = WorkerPlace(node_id="n1", pid=11, raylet_pid=3, time=1.5)
    fallback = Fallback(step=30, path="s/step_30", reason="sha256 mismatch", quarantined_to="q/30")
    restore = Restore(30, 1, 64, "s/step_20", 0.5, 0.25, 0.01, (fallback,), Tier.memory)
    resize = Notice(NoticeSource.resize, 9.0, 40, from_=2, to=1, requested=8.5)
    resize = dataclasses.replace(resize, jit=JitCheckpoint(40, path="s/step_40", seconds=1.0))
    attempts = (
        Attempt(0, 1.0, 2, {0: place}, None, None, resize, FirstStep(1, 2.0, 0.3, {"setup": 1})),
        Attempt(1, 10.0, 1, {0: place}, restore, max_step=55),
    )
    node = KillTarget("n2", ranks=(1,))
    kill = Kill(5.0, "node", node, 0, killed_pid=-1, confirmed=True)
    hang = Hang(7.0, 1, 0, "n1", 11, "step", 5, 2.0, 5.0, 3.0, 2.0, True, False, {1: "data"})
    return RunSnapshot(
        plan=RunPlan(100, 8, 96, 12, 0, 2, 2),
        started=0.5,
        finished=20.0,
        attempts=attempts,
        kills=(kill,),
        chaos_skipped=(ChaosSkip.of_kill(kill, "not confirmed dead before the run ended"),),
        checkpoints=(CheckpointRecord(10, "s/step_10", None, 0.5, 3.0, 0),),
        storage={"rank0": {"upload": {"calls": 3.0, "retries": 1.0}}},
        metrics={"train/loss": 0.5},
        watch=record.WatchRecord(hangs=(hang,)),
    )


def test_a_snapshot_survives_its_json_form_unchanged():
    snap = _rich_snapshot()
    text = json.dumps(snap.to_json())
    assert RunSnapshot.from_json(json.loads(text)) == snap
    data = json.loads(text)
    resize = data["attempts"][0]["resize"]
    assert resize["from"] == 2 and resize["source"] == "resize"  # the JSON keys as always
    assert "quarantined_to" in data["attempts"][1]["restored"]["skipped"][0]
    assert "left" not in data["attempts"][1]["restored"]["skipped"][0]  # optional, unset
    assert data["attempts"][0]["workers"] == {"0": place_json()}


def place_json() -> dict[str, Any]:
    return {"node_id": "n1", "pid": 11, "raylet_pid": 3, "time": 1.5}


def test_choices_are_their_strings():
    assert NoticeSource.driver == "driver" and f"{NoticeSource.driver}" == "driver"
    assert json.dumps({"tier": Tier.memory}) == '{"tier": "memory"}'


def test_a_heartbeat_of_a_rank_is_a_beat_not_a_dict():
    ledger = RunLedger(RunPlan())
    ledger.start_attempt(0.0, 1)
    ledger.register_worker(0, 0, WorkerPlace("n", 5, time=0.0))
    assert ledger.heartbeat(0, 0, Beat("step", 0.0, 1)) == 0.0
    with pytest.raises(AttributeError):
        ledger.heartbeat(0, 0, {"section": "step", "age": 0.0, "step": 1})  # type: ignore[arg-type]


def test_a_just_in_time_checkpoint_without_a_notice_is_kept_not_lost():
    # A notice always comes first; were its record lost, the checkpoint is still recorded.
    ledger = RunLedger(RunPlan())
    ledger.start_attempt(0.0, 1)
    ledger.jit_checkpoint(0, JitCheckpoint(7, path="s/step_7", seconds=0.5, time=3.0))
    notice = ledger.latest_preemption()
    assert notice is not None and notice.jit is not None and notice.jit.path == "s/step_7"


# The record past the ledger -- the driver's copy, summary.json and every record it is made
# of, the verdict -- and the modules that build, write and read it; and the calls that carry
# records to and from the ledger's actor (ftjob.actors): the workers', the chaos killer's, the
# elastic policy's and the drain relay's.
RECORD_MODULES = (
    "ftjob.record",
    "ftjob.driver.ledger",
    "ftjob.worker.recorder",
    "ftjob.chaos.killer",
    "ftjob.chaos.schedule",
    "ftjob.driver.scaling",
    "ftjob.driver.drains",
    "ftjob.reporting.run_summary",
    "ftjob.reporting.summary",
    "ftjob.reporting.failures",
    "ftjob.reporting.resizes",
    "ftjob.reporting.goodput",
    "ftjob.reporting.audit",
    "ftjob.reporting.verdict",
    "ftjob.reporting.timeline",
    "ftjob.reporting.run_record",
    "ftjob.reporting.schema",
    "ftjob.reporting.loggers",
    "ftjob.driver.held_record",
    "ftjob.driver.monitor",
    "ftjob.driver.runner",
    "ftjob.cli.app",
    "ftjob.cli.launcher",
    "ftjob.cli.report",
)
# What these modules take or give untyped that is no record of the run: the resolved config
# and the train catalog's fingerprint (free-form: the user's), the catalogs (Arrow tables),
# the experiment loggers (each backend's own object), a record class's field types.
NOT_RECORDS = {
    "ftjob.record.field_types:return",
    "ftjob.driver.ledger.RunLedger.watch_drains:actors",  # Ray Train's worker actors, by rank
    "ftjob.driver.drains.DrainWatch.watch_drains:actors",
    "ftjob.driver.drains.DrainRelay.watch:actors",
    "ftjob.reporting.loggers.runs_of:loggers",
    "ftjob.reporting.loggers.build_loggers:return",
    "ftjob.reporting.loggers.continued_loggers:storage",
    "ftjob.reporting.loggers.continued_loggers:return",
    "ftjob.reporting.loggers.LogFeed.params:config",
    "ftjob.driver.runner.Prepared.catalogs",
    "ftjob.driver.runner.Prepared.data",
    "ftjob.driver.runner.Prepared.public_config",
    "ftjob.driver.runner.worker_spec:catalogs",
}


def _untyped_container(hint: Any) -> bool:
    """``dict[str, Any]``, ``list[Any]`` and the like, anywhere in ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    containers = (dict, list, tuple, collections.abc.Mapping, collections.abc.Sequence)
    if origin in containers and args and Any in args:
        return True
    return any(_untyped_container(a) for a in args)


def _signatures(module: types.ModuleType) -> Iterator[tuple[str, Any]]:
    """``(where, hint)`` of every public function's and method's parameters and return, and
    of every public dataclass's fields, defined in ``module``."""
    namespace = {**vars(module), **vars(importlib.import_module("ftjob.driver.runner"))}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        where = f"{module.__name__}.{name}"
        functions = [(where, obj)] if inspect.isfunction(obj) else []
        if inspect.isclass(obj):
            functions = [
                (f"{where}.{n}", f)
                for n, f in vars(obj).items()
                if inspect.isfunction(f) and not n.startswith("_")
            ]
            if dataclasses.is_dataclass(obj):
                hints = typing.get_type_hints(obj)
                yield from ((f"{where}.{f.name}", hints[f.name]) for f in dataclasses.fields(obj))
        for at, function in functions:
            for param, hint in typing.get_type_hints(function, namespace).items():
                yield f"{at}:{param}", hint


def test_no_record_crosses_a_package_boundary_as_an_untyped_dict():
    """summary.json, the records it is made of, the verdict and the driver's record are
    types end to end: no public signature of the modules that make and read them takes or
    gives them as ``dict[str, Any]`` (or a list of Any)."""
    untyped = [
        f"{where}: {hint}"
        for name in RECORD_MODULES
        for where, hint in _signatures(importlib.import_module(name))
        if _untyped_container(hint) and where not in NOT_RECORDS
    ]
    assert not untyped, untyped
    assert {w.rsplit(":", 1)[0] for w in NOT_RECORDS} <= {
        w.rsplit(":", 1)[0]
        for name in RECORD_MODULES
        for w, _ in _signatures(importlib.import_module(name))
    }  # each exception still exists
