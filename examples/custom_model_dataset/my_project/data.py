"""Your dataset: subclass ftjob.datasets.ImageDataset.

- ``catalog(split)`` lists the samples (a small Arrow table: ``id`` = row index, ``label``, and
  whatever ``decode`` needs, e.g. a file path). ftjob orders, shards and resumes on ids only.
- ``decode(rows, split, epoch, seed)`` turns catalog rows into float32 NCHW images; it runs in
  Ray Data tasks. Draw randomness from ``sample_rng(seed, epoch, id)`` so a sample looks the
  same whichever attempt decodes it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ftjob.datasets import TRAIN, ImageDataset, sample_rng


class BarsDataset(ImageDataset):
    """Horizontal vs vertical bars on noise: two classes, generated, no download."""

    def __init__(self, num_samples: int = 1024, image_size: int = 24, noise: float = 0.3) -> None:
        self.num_samples, self.image_size, self.noise = num_samples, image_size, noise

    @property
    def num_classes(self) -> int:
        return 2

    def catalog(self, split: str) -> pa.Table:
        n = self.num_samples if split == TRAIN else self.num_samples // 4
        offset = 0 if split == TRAIN else 10**6  # validation images differ from training ones
        return pa.table(
            {
                "id": np.arange(n, dtype=np.int64),
                "label": np.arange(n, dtype=np.int64) % 2,
                "key": np.arange(offset, offset + n, dtype=np.int64),
            }
        )

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        size = self.image_size
        out = np.empty((len(rows["key"]), 3, size, size), dtype=np.float32)
        for i, (key, label) in enumerate(zip(rows["key"], rows["label"], strict=True)):
            rng = sample_rng(0, 0, int(key))  # the image itself is fixed per sample
            img = self.noise * rng.standard_normal((size, size)).astype(np.float32)
            pos = rng.integers(2, size - 2)
            if label:
                img[:, pos - 1 : pos + 1] += 1.0
            else:
                img[pos - 1 : pos + 1, :] += 1.0
            if split == TRAIN and sample_rng(seed, epoch, int(key)).random() < 0.5:
                img = img[::-1].copy() if label else img[:, ::-1].copy()  # label-preserving flip
            out[i] = img
        return out
