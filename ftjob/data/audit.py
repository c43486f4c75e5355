"""What a run's catalogs must hold before anything trains, whatever the dataset: samples in
both splits, and at least two classes among the training split's labelled samples. A run
without them does not fail on its own -- a split of zero rows is planned as no steps, or
refused by an arithmetic rule that does not say why; a training split of one class trains a
classifier that learns nothing and scores 1.0 -- so it would "succeed" on nothing. Checked by
the driver's preparation and ``python -m ftjob.check --data``, before Ray starts; each dataset
audits its own layout when it lists it (:mod:`ftjob.data.folders`, :mod:`ftjob.data.shards`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ftjob.data.datasets import GONE, TRAIN, VAL, ImageDataset
from ftjob.data.parquet import NO_LABEL

# Catalog columns that mark a row that is no sample: removed since the run started, or (Parquet)
# without a label.
NOT_SAMPLES = (GONE, NO_LABEL)


def audit_catalogs(dataset: ImageDataset, catalogs: dict[str, pa.Table]) -> None:
    """Refuse catalogs a run would train on nothing with (a ``ValueError`` naming the
    dataset, the split and what to do)."""
    for split in (TRAIN, VAL):
        if catalogs[split].num_rows == 0:
            raise ValueError(
                f"{dataset.describe()}: the {split} split has no samples (its files or shards "
                "hold no rows): a run would train or validate on nothing; point the dataset at "
                "data with both splits"
            )
    present = labelled_classes(catalogs[TRAIN])
    if len(present) < 2:
        names = _class_names(dataset)
        only = names[present[0]] if len(present) and present[0] < len(names) else present
        raise ValueError(
            f"{dataset.describe()}: every labelled training sample is of one class ({only}): a "
            "classifier needs at least 2 classes -- with one, every label is the same, the run "
            "learns nothing and scores 1.0; point the dataset at the folder that holds a "
            "folder (or a label) per class"
        )


def labelled_classes(catalog: pa.Table) -> np.ndarray:
    """The distinct labels of the catalog's rows that are samples."""
    labels = np.asarray(catalog.column("label"))
    keep = np.ones(len(labels), bool)
    for column in NOT_SAMPLES:
        if column in catalog.column_names:
            keep &= ~np.asarray(catalog.column(column), dtype=bool)
    return np.unique(labels[keep])


def _class_names(dataset: ImageDataset) -> list[Any]:
    classes = getattr(dataset, "classes", None)
    return list(classes) if isinstance(classes, list) else list(range(dataset.num_classes))


def audited_catalogs(dataset: ImageDataset) -> dict[str, pa.Table]:
    """Both splits' catalogs, as listed now, audited (:func:`audit_catalogs`)."""
    catalogs = {split: dataset.catalog(split) for split in (TRAIN, VAL)}
    audit_catalogs(dataset, catalogs)
    return catalogs
