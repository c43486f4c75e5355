"""Run names and resumption: a new run never silently continues an old one, and a resumed run
refuses changes its checkpoint cannot follow.

Two checks, cheap first: :func:`check_run_name` (before the dataset is listed: does the run
exist, may it be continued; for ``resume=auto``, whether it is continued or started) and :func:`check_resume` (after: the config and the training data
the newest checkpoint was trained on). Every key of the config is one of two
kinds on a resume (the table in docs/fault-tolerance.md, "What a resume may change"): refused
where the newest checkpoint was made with it and cannot be followed -- its weights (``model``),
its data order (the train catalog, ``dataset``, the global batch, the seed), its optimizer state
(``optimizer``, the parameter groups) and exact mode's arithmetic -- with the diff, before Ray
starts; honoured everywhere else (more epochs, another learning rate, other storage, chaos or
cluster), each change said in one line at the run's start. None is kept silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ftjob.config import RESUME_AUTO, JobConfig, fsspec_protocol, to_plain
from ftjob.config.trainer import exact_micro_batch
from ftjob.data.datasets import GONE, SOURCES
from ftjob.storage.catalog import Listed
from ftjob.storage.checkpoint import CheckpointStore, CorruptCheckpoint, NewerFormat
from ftjob.storage.lease import LEASE_DIR

# Dataset keys that say where the data is, not what it is: moving the data is honoured (said).
LOCATION_KEYS = ("path", "storage_options")
# What a file that does not decode does (a policy, honoured and said), not what the data is.
DECODE_POLICY_KEYS = ("bad_files", "max_image_pixels", "max_bad_fraction")
# Groups whose every key the checkpoint was made with (``_target_`` nodes: a key added or
# dropped is a change too), and why each is refused.
REFUSED_GROUPS = {
    "model": "the checkpoint's weights are this model's",
    "dataset": "the data the checkpoint trained on, and its order",
    # torch's load_state_dict puts the checkpoint's hyperparameters back with its moments: a
    # change would be written in config.json and never trained with.
    "optimizer": "the checkpoint's optimizer state puts its own back",
}
# Which run, and how it was asked: not a change of what it does.
NOT_CHANGES = ("name", "resume")
# Steps a run is told to act at: the ones a checkpoint is past are never reached again.
STEP_LISTS = ("chaos.fail_at_steps", "chaos.at_steps")
GLOBAL_BATCH = "trainer.batch_size x trainer.num_workers (global batch)"
SEED = "trainer.seed (data order)"
GROUPS = "trainer.weight_decay_norm_and_bias (the optimizer state's parameter groups)"
EXACT = "trainer.exact (exact mode's arithmetic, from the run's first step)"
MICRO = "trainer.micro_batch_size (exact mode's micro-batch: its arithmetic)"
# Trainer keys the checkpoint was made with: refused, their lines above.
REFUSED_TRAINER_KEYS = ("seed", "weight_decay_norm_and_bias", "exact")


class ResumeError(RuntimeError):
    """The run to resume is missing, or the config or data changed incompatibly."""


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _fingerprint(config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint depends on: the model, the dataset, the data order, the optimizer
    state's making, exact mode's arithmetic. Keys a checkpoint written before they existed
    lacks are read at their defaults."""
    t = config["trainer"]
    dataset = {
        k: v for k, v in config["dataset"].items() if k not in LOCATION_KEYS + DECODE_POLICY_KEYS
    }
    global_batch = t["batch_size"] * t["num_workers"]
    exact = bool(t.get("exact", False))
    micro = t.get("micro_batch_size") or exact_micro_batch(global_batch)
    return {
        **_flatten(config["model"], "model"),
        **_flatten(dataset, "dataset"),
        **_flatten(config.get("optimizer") or {}, "optimizer"),
        GLOBAL_BATCH: global_batch,
        SEED: t["seed"],
        GROUPS: t.get("weight_decay_norm_and_bias", True),
        EXACT: exact,
        **({MICRO: micro} if exact else {}),
    }


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def breaking_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Lines ``key: saved -> current (why)`` for every difference that breaks the checkpoint."""
    lines = []
    for line in _diff(_fingerprint(saved), _fingerprint(current)):
        why = REFUSED_GROUPS.get(line.split(".", 1)[0])
        lines.append(f"{line} ({why})" if why else line)
    return lines


def _refused(key: str) -> bool:
    """Is ``key`` (dotted) one whose change :func:`breaking_changes` refuses?"""
    group, _, rest = key.partition(".")
    if group == "dataset":
        return rest.split(".", 1)[0] not in LOCATION_KEYS + DECODE_POLICY_KEYS
    return group in REFUSED_GROUPS or (group == "trainer" and rest in REFUSED_TRAINER_KEYS)


def stated_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Every other difference: honoured by the resumed run, and said in its output. A key the
    checkpoint's config lacks (written before the key existed) is said as such."""
    old, new = _flatten(saved), _flatten(current)
    lines = []
    for key in sorted(set(old) | set(new)):
        if key in NOT_CHANGES or _refused(key) or old.get(key) == new.get(key):
            continue
        before = repr(old[key]) if key in old else "(not in the checkpoint's config)"
        lines.append(f"{key}: {before} -> {new.get(key)!r}")
    return lines


def catalog_fingerprint(table: pa.Table, num_classes: int) -> dict[str, Any]:
    """The train catalog as a checkpoint remembers it: rows, the real class count, and a hash
    of every column (ids, labels, sources). Source paths are hashed relative to their common
    root, so a dataset copied to another place is the same dataset. The ``gone`` marks of
    rows removed since the run started (:mod:`ftjob.driver.started_catalog`) are not part of
    it: those rows keep their places. A catalog whose dataset states its sources (Parquet
    shards: names, sizes, rows; :data:`~ftjob.data.datasets.SOURCES`) is remembered by them,
    so a resume diffs them one by one."""
    sources = (table.schema.metadata or {}).get(SOURCES)
    if sources is not None:
        stated = json.loads(sources)
        return {"train_rows": table.num_rows, **stated, "num_classes": int(num_classes)}
    digest = hashlib.sha256()
    for name in sorted(set(table.column_names) - {GONE}):
        values = table.column(name).to_pylist()
        if name == "path" and values:
            root = os.path.commonprefix([str(v) for v in values])
            values = [str(v)[len(root) :] for v in values]
        digest.update(name.encode())
        for value in values:
            item = value if isinstance(value, bytes) else repr(value).encode()
            digest.update(len(item).to_bytes(8, "big") + item)
    return {
        "train_rows": table.num_rows,
        "train_sha256": digest.hexdigest()[:32],
        "num_classes": int(num_classes),
    }


def _latest(store: CheckpointStore) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(config, state) saved in the newest committed checkpoint that reads, in the run's
    order (lease generation, then step: what the workers restore); one pruned while it was
    read is passed for the newer one that replaced it. A newest checkpoint of a newer
    format is refused (:class:`ResumeError`, naming both formats)."""

    def read(entry: Listed) -> tuple[dict[str, Any], dict[str, Any]]:
        manifest = store.read_manifest(entry.step)
        try:
            config = json.loads(store.read_file(entry.step, "config.json", manifest))
            state = json.loads(store.read_file(entry.step, "state.json", manifest))
        except ValueError as exc:
            raise CorruptCheckpoint(f"unreadable config or state ({exc})") from None
        return config, state

    try:
        found = store.newest(read)
    except NewerFormat as exc:
        raise ResumeError(str(exc)) from None
    return found[1] if found else None


def latest_config(store: CheckpointStore) -> dict[str, Any] | None:
    """The config saved in the newest committed checkpoint."""
    latest = _latest(store)
    return latest[0] if latest else None


def _place(url: str) -> tuple[str, str]:
    """(protocol, path) of a storage URL or path, local paths resolved: what two URLs are
    compared by."""
    protocol = fsspec_protocol(url)
    path = re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", url)
    if protocol in ("file", "local"):
        return "file", os.path.realpath(path)
    return protocol, path.rstrip("/")


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def check_run_place(fs: Any, storage_url: str, run_path: str, dataset_path: str | None) -> None:
    """A run's directory (``run_path`` on ``fs``, under ``storage_url``) must not lie in the
    dataset (its checkpoints would become part of the data, and a prune would delete in
    it), nor inside another run's directory, where that run's retention and quarantine
    act on everything under its ``checkpoints/``."""
    protocol, _ = _place(storage_url)
    here = ("file", os.path.realpath(run_path)) if protocol == "file" else (protocol, run_path)
    if isinstance(dataset_path, str) and dataset_path:
        data = _place(dataset_path)
        if here[0] == data[0] and _within(here[1], data[1]):
            raise ResumeError(
                f"checkpoint.storage_path={storage_url!r}: the run's checkpoints would be written "
                f"inside dataset.path={dataset_path!r}; keep checkpoints beside the data"
            )
    directory = posixpath.dirname(run_path.rstrip("/"))
    while directory:
        if _is_run_dir(fs, directory):
            raise ResumeError(
                f"checkpoint.storage_path={storage_url!r}: inside the directory of run "
                f"{posixpath.basename(directory)!r} ({directory}), whose retention and "
                "quarantine act on what is under it; choose a path outside every run's directory"
            )
        parent = posixpath.dirname(directory.rstrip("/"))
        directory = "" if parent == directory else parent


def _is_run_dir(fs: Any, directory: str) -> bool:
    """A run's directory: it holds the run lease, or checkpoint directories."""
    try:
        return fs.exists(posixpath.join(directory, LEASE_DIR)) or bool(
            CheckpointStore(fs, directory).steps()
        )
    except OSError:  # a parent this user may not list holds no run of theirs
        return False


@dataclass(frozen=True)
class Resumption:
    """How the driver takes up the run called ``name``: continued from its newest committed
    checkpoint (``step``), or started; ``said``: the line that tells which and why
    (``resume=auto``)."""

    continues: bool
    step: int | None = None
    said: str | None = None


def asked(job: JobConfig) -> str:
    """``resume=...`` as the user asked it, for messages."""
    return f"resume={'auto' if job.resume == RESUME_AUTO else 'true' if job.resume else 'false'}"


def _instead(job: JobConfig) -> str:
    """How to start a new run instead, for messages."""
    return "choose another name" if job.resume == RESUME_AUTO else "drop resume=true"


def check_run_name(job: JobConfig, store: CheckpointStore, url: str) -> Resumption:
    """A new run must not reuse a name that has checkpoints; a resumed one must find them.
    ``resume=auto`` decides: continue when the run has a committed checkpoint (one whose
    manifest, config and state read, as ``resume=true`` requires), start when it has none;
    directories without a manifest (uploads that never completed: no checkpoint, the
    workers' restore sets them aside) do not count. A checkpoint that was committed but does
    not read is refused as ``resume=true`` refuses it: a run is never started over on top of
    a damaged one without a person deciding."""
    steps = store.steps()
    if job.resume is False:
        if steps:
            raise ResumeError(
                f"name={job.name!r}: a run with this name already has checkpoints at {url}; "
                "pass resume=true (or resume=auto) to continue it, or choose another name"
            )
        return Resumption(False)
    latest = _latest(store) if steps else None
    if latest is not None:
        step = int(latest[1].get("step") or 0)
        if job.resume is True:
            return Resumption(True, step)
        said = f"resume=auto: run {job.name!r} has a committed checkpoint at step {step} in {url}"
        return Resumption(True, step, f"{said}: continuing it")
    committed = store.committed_steps() if steps else []
    if job.resume is True or committed:
        damaged = f" (committed, but none reads: steps {committed})" if committed else ""
        raise ResumeError(
            f"{asked(job)}: no committed checkpoint of run {job.name!r} at {url}{damaged}; "
            "check name= and checkpoint.storage_path= (the storage of the run to continue)"
            + (", and look at those checkpoints before starting the run over" if damaged else "")
        )
    unfinished = f" (steps {steps}: uploads that never completed)" if steps else ""
    return Resumption(
        False,
        said=f"resume=auto: no committed checkpoint of run {job.name!r} at {url}{unfinished}: "
        "starting it",
    )


def check_resume(
    job: JobConfig,
    store: CheckpointStore,
    url: str,
    data: dict[str, Any],
    current: dict[str, Any] | None = None,
) -> list[str]:
    """For a run that continues (``resume=true``, or ``auto`` with a committed checkpoint):
    refuse a config or train data the newest checkpoint cannot follow, or one that leaves
    nothing to train (:class:`NothingLeftToTrain`); return what the run should say (allowed
    changes, steps it will not reach). ``data`` is :func:`catalog_fingerprint` now;
    ``current`` the config as checkpoints keep it (secrets redacted, as in the saved one)."""
    latest = _latest(store) if job.resume is not False else None
    if latest is None:
        return []
    saved, state = latest
    current = to_plain(job) if current is None else current
    changes = breaking_changes(saved, current)
    trained_on = state.get("data")
    if trained_on is not None:
        changes += [f"train data {line}" for line in _diff(trained_on, data)]
    if changes:
        raise ResumeError(
            f"{asked(job)}: run {job.name!r} cannot continue with this config or data; its "
            "checkpoint needs:\n  "
            + "\n  ".join(changes)
            + f"\nrevert these changes, or start a new run ({_instead(job)})"
        )
    check_left_to_train(job, state, data.get("train_rows"))
    allowed = [
        f"{line} (changed since the checkpoint; allowed)" for line in stated_changes(saved, current)
    ]
    return allowed + steps_behind(current, state)


class NothingLeftToTrain(ResumeError):
    """The checkpoint to continue from is at or past the run's last step (``step``)."""

    def __init__(self, message: str, step: int, total: int) -> None:
        super().__init__(message)
        self.step, self.total = step, total


def check_left_to_train(job: JobConfig, state: dict[str, Any], train_rows: int | None) -> None:
    """A resume must have steps left to train: ``trainer.epochs`` at or below what the
    checkpoint has trained would end the run at once, "succeeded", with its step past the
    asked total. Refused (:class:`NothingLeftToTrain`), with the epochs that would train on;
    ``resume=auto`` takes it as a finished run (the driver's :func:`finished_line`)."""
    step, batch = int(state.get("step") or 0), job.trainer.global_batch_size
    if not train_rows or batch > train_rows:
        return  # the epoch plan refuses this batch itself
    per_epoch = train_rows // batch
    total = per_epoch * job.trainer.epochs
    if step < total:
        return
    trained = "all of them" if step == total else f"{step - total} steps past them"
    raise NothingLeftToTrain(
        f"trainer.epochs={job.trainer.epochs}: run {job.name!r} has nothing left to train: its "
        f"checkpoint is at step {step}, and {job.trainer.epochs} epochs of {per_epoch} steps are "
        f"{total} ({trained}); pass trainer.epochs={step // per_epoch + 1} or more to train on, "
        f"or start a new run ({_instead(job)})",
        step,
        total,
    )


def finished_line(job: JobConfig, url: str, done: NothingLeftToTrain) -> str:
    """What ``resume=auto`` says of a run whose checkpoint is at its last step: it is finished
    (a scheduler that reruns a finished job gets success, not a failure to retry)."""
    past = "its last step" if done.step == done.total else f"past its last step {done.total}"
    return (
        f"resume=auto: run {job.name!r} has a committed checkpoint at step {done.step} in {url}, "
        f"{past} (trainer.epochs={job.trainer.epochs}): the run is finished, nothing to train "
        "(pass a larger trainer.epochs to train on)"
    )


def steps_behind(current: dict[str, Any], state: dict[str, Any]) -> list[str]:
    """Lines for the steps ``chaos.fail_at_steps`` / ``chaos.at_steps`` name that the
    checkpoint is already past: a resumed run never reaches them (stated, not refused: the
    resume command a run prints keeps the overrides it was started with)."""
    flat, step = _flatten(current), int(state.get("step") or 0)
    lines = []
    for key in STEP_LISTS:
        behind = [s for s in flat.get(key) or [] if s <= step]
        if behind:
            lines.append(
                f"{key}: {behind} are at or behind the checkpoint's step {step}: not reached"
            )
    return lines
