"""The train catalog a run started with, kept beside its checkpoints, so that a resume after
dataset files were removed (a bad file taken out, say) keeps the data order.

Exact-once rests on the epoch order, a function of the train catalog's rows; a catalog listed
again without a removed file would shift every id after it, and the checkpoint could not be
continued. Instead, on ``resume=true`` the catalog is rebuilt from the one the run started
with: a removed file keeps its row, marked ``gone`` (never read; its sample is skipped in
every epoch as a bad file is), and the change is stated. Files added since, or moved to
another class, are not followed: the resume check refuses them with the diff.
"""

from __future__ import annotations

import io
import os
import posixpath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ftjob.config import JobError
from ftjob.data.bad_files import MAX_BAD_FRACTION, bad_limit
from ftjob.data.datasets import GONE

CATALOG_FILE = "data/train_catalog.parquet"  # under the run's directory
PATH = "path"


def _relative(paths: list[str]) -> tuple[str, list[str]]:
    """Paths relative to their common directory, and that directory (``/``-ended): a dataset
    moved elsewhere has the same relative paths, and so does one with a file removed (a
    character prefix would grow when the removed file was the one that differed)."""
    prefix = os.path.commonprefix(paths) if paths else ""
    root = prefix[: prefix.rfind("/") + 1]
    return root, [p[len(root) :] for p in paths]


def remember_catalog(fs: Any, run_path: str, table: pa.Table) -> None:
    """At the run's first start: its train catalog (ids, labels, paths relative to their
    common root), unless one is kept already. Only catalogs of files (a ``path`` column)."""
    if PATH not in table.column_names or GONE in table.column_names:
        return
    target = posixpath.join(run_path, CATALOG_FILE)
    if fs.exists(target):
        return
    _, rel = _relative([str(p) for p in table.column(PATH).to_pylist()])
    kept = pa.table({"id": table.column("id"), "label": table.column("label"), PATH: rel})
    out = io.BytesIO()
    pq.write_table(kept, out, compression="zstd")
    fs.makedirs(posixpath.dirname(target), exist_ok=True)
    fs.pipe_file(target, out.getvalue())


def started_catalog(
    fs: Any, run_path: str, table: pa.Table, resume: bool, max_gone: float = MAX_BAD_FRACTION
) -> tuple[pa.Table, list[str]]:
    """The train catalog to train on (``table``: as listed now), and what to state. On
    ``resume``, when files the run started with are gone (and nothing was added or
    relabelled): the run's first catalog, those rows marked ``gone``; otherwise ``table``
    (the resume check then compares it with the checkpoint's). More gone than ``max_gone``
    of the catalog (``dataset.max_bad_fraction``: a half-synced copy, a wrong mount) is
    refused: the run would go on, and succeed, on what is left."""
    target = posixpath.join(run_path, CATALOG_FILE)
    if (
        not resume
        or PATH not in table.column_names
        or set(table.column_names) - {"id", "label", PATH}
    ):
        return table, []
    try:
        kept = pq.read_table(io.BytesIO(fs.cat_file(target)))
    except FileNotFoundError:
        return table, []
    root, now = _relative([str(p) for p in table.column(PATH).to_pylist()])
    before = [str(p) for p in kept.column(PATH).to_pylist()]
    labels_now = dict(zip(now, table.column("label").to_pylist(), strict=True))
    labels_before = kept.column("label").to_pylist()
    gone = [p not in labels_now for p in before]
    same_labels = all(
        g or labels_now[p] == label for p, label, g in zip(before, labels_before, gone, strict=True)
    )
    if not any(gone) or len(now) != len(before) - sum(gone) or not same_labels:
        return table, []
    rebuilt = pa.table(
        {
            "id": kept.column("id"),
            "label": kept.column("label"),
            PATH: [root + p for p in before],
            GONE: np.asarray(gone, dtype=bool),
        }
    )
    removed = [p for p, g in zip(before, gone, strict=True) if g]
    shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
    if len(removed) > bad_limit(len(before), max_gone):
        raise JobError(
            f"dataset.max_bad_fraction={max_gone:g}: {len(removed)} of the {len(before)} train "
            f"files the run started with are gone from {root} ({shown}); put them back, or "
            "raise dataset.max_bad_fraction to continue the run without them"
        )
    return rebuilt, [
        f"train data: {len(removed)} file(s) removed since the run started ({shown}): each "
        "keeps its place in the data order and is skipped, so the order and exact-once hold"
    ]
