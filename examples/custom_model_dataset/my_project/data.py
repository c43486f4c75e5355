"""Your dataset: subclass ftjob.datasets.ImageDataset.

- ``catalog(split)`` lists the samples (a small Arrow table: ``id`` = row index, ``label``, and
  whatever ``decode`` needs, here the file's path). ftjob orders, shards and resumes on ids only.
- ``decode(rows, split, epoch, seed)`` turns catalog rows into NCHW images; it runs in Ray Data
  tasks. Return uint8 (0..255) and say in ``normalisation()`` what to normalise with: ftjob
  normalises on the training device, and a quarter of the bytes go through Ray's object store
  (float32, already normalised, works too). Draw randomness from ``sample_rng(seed, epoch, id)``
  so a sample looks the same whichever attempt decodes it.

This one reads the way many teams' datasets are kept: image files anywhere fsspec reaches
(a local path, ``s3://...``, ``gs://...``) and a CSV per split that lists them with their label.
"""

from __future__ import annotations

import csv
import io
import posixpath

import fsspec
import numpy as np
import pyarrow as pa
from PIL import Image

from ftjob.datasets import TRAIN, ImageDataset, sample_rng

CLASSES = ("horizontal", "vertical")


class BarsDataset(ImageDataset):
    """Pictures of horizontal or vertical bars: ``{root}/{split}.csv`` lists ``file,label``
    (a file path relative to ``root``, a class name); ``python -m my_project.make_bars ROOT``
    writes a small set."""

    def __init__(self, root: str, image_size: int = 24) -> None:
        self.root, self.image_size = root.rstrip("/"), image_size

    @property
    def num_classes(self) -> int:
        return len(CLASSES)

    def catalog(self, split: str) -> pa.Table:
        with fsspec.open(f"{self.root}/{split}.csv", "r") as f:
            rows = list(csv.DictReader(f))
        return pa.table(
            {
                "id": np.arange(len(rows), dtype=np.int64),
                "label": np.array([CLASSES.index(r["label"]) for r in rows], dtype=np.int64),
                "path": [posixpath.join(self.root, r["file"]) for r in rows],
            }
        )

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        size = self.image_size
        out = np.empty((len(rows["path"]), 3, size, size), dtype=np.uint8)
        for i, (path, sample) in enumerate(zip(rows["path"], rows["id"], strict=True)):
            with fsspec.open(str(path), "rb") as f:
                img = Image.open(io.BytesIO(f.read())).convert("RGB").resize((size, size))
            pixels = np.asarray(img, dtype=np.uint8)
            if split == TRAIN and sample_rng(seed, epoch, int(sample)).random() < 0.5:
                pixels = pixels[::-1, ::-1]  # a half turn keeps bars horizontal or vertical
            out[i] = pixels.transpose(2, 0, 1)
        return out

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
