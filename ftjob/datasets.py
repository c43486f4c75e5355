"""The public name of ftjob's datasets (``dataset._target_: ftjob.datasets.DigitsDataset``; your
own: subclass :class:`ImageDataset`). They live in :mod:`ftjob.data.datasets`."""

from ftjob.data.datasets import (
    TRAIN,
    VAL,
    DataError,
    DigitsDataset,
    ImageDataset,
    ImageFolderDataset,
    SyntheticDataset,
    sample_rng,
)
from ftjob.data.folders import IMAGE_EXTENSIONS
from ftjob.data.parquet import ParquetDataset

__all__ = [
    "IMAGE_EXTENSIONS",
    "TRAIN",
    "VAL",
    "DataError",
    "DigitsDataset",
    "ImageDataset",
    "ImageFolderDataset",
    "ParquetDataset",
    "SyntheticDataset",
    "sample_rng",
]
