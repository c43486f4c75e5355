"""``python -m ftjob.check --data [overrides...]``: the job's dataset, listed and audited as a
run lists it, then every file read and decoded up front, in parallel, and the bad ones listed
-- for those who want to know before hour one, not when a run meets them.

The overrides are a run's (``dataset=imagefolder dataset.path=/data/imagenet``). Each file is
decoded as validation decodes it (:meth:`ImageFolderDataset.check_file`), in a pool of
processes (``--jobs``, default: the cores this process may use -- its CPU affinity within its
cgroup's quota, :func:`ftjob.driver.machine.usable_cpus` -- not the host's), with the dataset's own limits
(``dataset.max_image_pixels``); Parquet shards (``dataset=parquet``) row by row, in this
process, each row group read once, a bad row named by its shard and row. Exit 0 when every file decodes, 1 when any does not (or the
tree fails its audit: an empty class folder, validation classes that differ...), 2 when the
command is wrong. With bad files, it says per split whether a run with
``dataset.bad_files=skip`` would stay within ``dataset.max_bad_fraction`` or fail.
"""

from __future__ import annotations

import concurrent.futures
import copy
import multiprocessing
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ftjob.config import ConfigError, load_job, register_schema
from ftjob.config.compose import Composer, Target
from ftjob.data.audit import audited_catalogs
from ftjob.data.bad_files import over_budget
from ftjob.data.datasets import TRAIN, VAL, ImageDataset, build_dataset
from ftjob.driver.machine import usable_cpus


@dataclass(frozen=True)
class BadEntry:
    """A listed file that does not decode: its split, path and reason."""

    split: str
    path: str
    reason: str

    def line(self) -> str:
        return f"BAD    {self.split} {self.path}: {self.reason}"


def _check_chunk(dataset: ImageDataset, split: str, paths: list[str]) -> list[BadEntry]:
    """In a pool process: the bad files among ``paths``."""
    check = dataset.check_file  # type: ignore[attr-defined]  # check_data sends only those with one
    out = []
    for path in paths:
        reason = check(path)
        if reason is not None:
            out.append(BadEntry(split, path, reason))
    return out


def find_bad_files(dataset: ImageDataset, files: dict[str, list[str]], jobs: int) -> list[BadEntry]:
    """Every file of ``files`` (split -> paths) decoded in ``jobs`` processes (spawned: no
    filesystem client or thread is inherited); the bad ones, in listing order."""
    work: list[tuple[str, list[str]]] = []
    for split, paths in files.items():
        size = max(1, min(256, len(paths) // (jobs * 8)))  # a few chunks per process
        work += [(split, paths[i : i + size]) for i in range(0, len(paths), size)]
    if not work:
        return []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        results = pool.map(_check_chunk, [dataset] * len(work), *zip(*work, strict=True))
        return [bad for chunk in results for bad in chunk]


def find_bad_rows(dataset: ImageDataset, catalogs: dict[str, pa.Table]) -> list[BadEntry]:
    """Every row of catalogs without files (Parquet shards: ``check_row``) decoded here, as
    validation decodes it, a block at a time (each row group read once); the bad ones, each
    named by the dataset (shard and row) with its reason."""
    skipping = copy.copy(dataset)
    skipping.bad_files = "skip"
    out = []
    for split, table in catalogs.items():
        for start in range(0, table.num_rows, ROWS_PER_BLOCK):
            block = table.slice(start, ROWS_PER_BLOCK)
            rows = {k: block.column(k).to_numpy(zero_copy_only=False) for k in block.column_names}
            _, skipped = skipping.decode_batch(rows, VAL, 0, 0)
            for i in np.flatnonzero(skipped):
                bad = dataset.bad_file(block.slice(int(i), 1).to_pylist()[0])
                out.append(BadEntry(split, bad.path, bad.reason))
    return out


ROWS_PER_BLOCK = 1024


def _say(line: str) -> None:
    print(f"ftjob.check --data: {line}", flush=True)


def check_data(overrides: Sequence[str], jobs: int | None = None) -> int:
    """Compose the job as ``python -m ftjob`` would, list its dataset, decode every file."""
    register_schema()
    try:
        job = load_job(Composer().compose(Target("command line"), overrides))
    except (ConfigError, HydraException, OmegaConfBaseException) as exc:
        print(f"ftjob.check --data: {exc}", file=sys.stderr)
        return 2
    finally:
        GlobalHydra.instance().clear()
    try:
        dataset = build_dataset(job.dataset)
        fraction = dataset.max_bad_fraction
        dataset.max_bad_fraction = 1.0  # every bad row listed here; the budget said at the end
        catalogs = audited_catalogs(dataset)
        notes = dataset.catalog_notes()
    except (ConfigError, ValueError, FileNotFoundError, PermissionError) as exc:
        _say(f"ERROR {exc}")
        return 1
    for note in notes:
        _say(note)
    if hasattr(dataset, "check_row"):
        total = sum(t.num_rows for t in catalogs.values())
        _say(
            f"{dataset.describe()}: decoding {catalogs[TRAIN].num_rows} {TRAIN} + "
            f"{catalogs[VAL].num_rows} {VAL} rows in this process"
        )
        bad = find_bad_rows(dataset, catalogs)
    elif not hasattr(dataset, "check_file") or "path" not in catalogs[TRAIN].column_names:
        _say(f"{dataset.describe()} reads no files: nothing to decode")
        return 0
    else:
        files = {s: [str(p) for p in t.column("path").to_pylist()] for s, t in catalogs.items()}
        jobs = max(1, jobs or usable_cpus())  # the cores of this process's affinity and cgroup
        total = sum(len(paths) for paths in files.values())
        _say(
            f"{dataset.describe()}: decoding {len(files[TRAIN])} {TRAIN} + {len(files[VAL])} "
            f"{VAL} files in {jobs} process(es)"
        )
        bad = find_bad_files(dataset, files, jobs)
    for entry in bad:
        print(entry.line(), flush=True)
    if not bad:
        _say(f"all {total} files decode")
        return 0
    _say(
        f"{len(bad)} bad file(s) of {total}: remove or fix them, or run with "
        "dataset.bad_files=skip (each is left out of every epoch and listed in summary.json)"
    )
    for line in budget_lines(bad, catalogs, fraction):
        _say(line)
    return 1


def budget_lines(bad: list[BadEntry], catalogs: dict[str, pa.Table], fraction: float) -> list[str]:
    """Per split, whether a run with ``dataset.bad_files=skip`` would stay within
    ``dataset.max_bad_fraction`` of it (:mod:`ftjob.data.bad_files`) with these bad files."""
    out = []
    for split, table in catalogs.items():
        count = sum(1 for entry in bad if entry.split == split)
        over = over_budget(split, count, table.num_rows, fraction)
        if over:
            out.append(f"with dataset.bad_files=skip a run fails: {over}")
        elif count:
            out.append(
                f"with dataset.bad_files=skip a run skips {count} of the {table.num_rows} "
                f"{split} samples, within dataset.max_bad_fraction={fraction}"
            )
    return out
