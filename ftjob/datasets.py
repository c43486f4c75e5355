"""Image datasets: a catalog of samples (built once, on the driver) and a decode step (run in
Ray Data tasks).

A dataset is split into a *catalog* -- a small Arrow table with one row per sample, ``id`` equal
to the row index and ``label`` -- and :meth:`ImageDataset.decode`, which turns catalog rows into
image tensors. Sample order, sharding and resumption work on catalog ids only
(:mod:`ftjob.data`), so nothing is read or decoded to skip ahead. Any randomness in ``decode``
comes from ``(seed, epoch, id)``, so a sample looks the same whichever attempt decodes it.

Your own dataset: subclass :class:`ImageDataset` and point ``dataset._target_`` at it.
"""

from __future__ import annotations

import io
import math
import posixpath
from abc import ABC, abstractmethod
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from ftjob.config import ConfigError

TRAIN, VAL = "train", "val"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def _dataset_rule(ok: bool, key: str, args: dict[str, Any], rule: str) -> None:
    if not ok:
        value = args[key]
        raise ConfigError(
            f"dataset.{key}", list(value) if isinstance(value, tuple) else value, rule
        )


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """The random stream of one sample in one epoch, independent of batching and attempts."""
    return np.random.default_rng([seed, epoch, sample_id])


class ImageDataset(ABC):
    """Labelled images with a fixed train/val split."""

    @property
    @abstractmethod
    def num_classes(self) -> int: ...

    @abstractmethod
    def catalog(self, split: str) -> pa.Table:
        """One row per sample of ``split``: ``id`` (== row index), ``label``, source columns."""

    @abstractmethod
    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        """Images for catalog rows, NCHW: uint8 (0..255), normalised on the training device with
        :meth:`normalisation` -- a quarter of the bytes through the object store -- or float32,
        already normalised. Runs inside Ray Data tasks."""

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel (mean, std), in units of the full 0..1 range, that uint8 images from
        :meth:`decode` are normalised with on the device; None for float32 images."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        """Refuse constructor arguments that could only fail later, inside decode tasks on the
        cluster (raise :class:`~ftjob.config.ConfigError` naming ``dataset.KEY``). Called with
        every argument, defaults included, by config validation and ``python -m ftjob.check``:
        it must not read any data."""
        return None


def _draft(img: Any, shrink: float) -> tuple[Any, float]:
    """``img`` set to decode at a reduced scale (JPEG only: PIL's draft mode) that keeps at
    least ``1/shrink`` of its size, and the scale it got: 1/2, 1/4, 1/8, or 1.0 for none."""
    if shrink < 2 or img.format != "JPEG":
        return img, 1.0
    width = img.size[0]
    img.draft("RGB", (math.ceil(img.size[0] / shrink), math.ceil(img.size[1] / shrink)))
    # The reduced size is rounded up (1001 px at 1/2: 501), so the scale is the power of two.
    return img, 1.0 / round(width / img.size[0])


class DigitsDataset(ImageDataset):
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), rendered as RGB
    images of ``image_size`` pixels. Needs no download; the train/val split is fixed and
    stratified."""

    def __init__(
        self,
        image_size: int = 32,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        augment: bool = False,
    ) -> None:
        self.check_args(image_size=image_size, val_fraction=val_fraction)
        self.image_size = image_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.augment = augment

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        _dataset_rule(
            kwargs["image_size"] >= 8, "image_size", kwargs, "must be >= 8 (digits are 8x8)"
        )
        _dataset_rule(0 < kwargs["val_fraction"] < 1, "val_fraction", kwargs, "must be in (0, 1)")

    @property
    def num_classes(self) -> int:
        return 10

    def catalog(self, split: str) -> pa.Table:
        from sklearn.datasets import load_digits

        digits = load_digits()
        pixels = digits.images.astype(np.uint8)  # (1797, 8, 8), values 0..16
        labels = digits.target.astype(np.int64)
        rng = np.random.default_rng(self.split_seed)
        val_mask = np.zeros(len(labels), dtype=bool)
        for cls in range(10):
            members = np.flatnonzero(labels == cls)
            chosen = rng.permutation(members)[: round(len(members) * self.val_fraction)]
            val_mask[chosen] = True
        keep = val_mask if split == VAL else ~val_mask
        chosen_pixels, chosen_labels = pixels[keep], labels[keep]
        return pa.table(
            {
                "id": np.arange(len(chosen_labels), dtype=np.int64),
                "label": chosen_labels,
                "pixels": [p.tobytes() for p in chosen_pixels],
            }
        )

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        small = np.stack([np.frombuffer(p, dtype=np.uint8).reshape(8, 8) for p in rows["pixels"]])
        small = small.astype(np.float32) / 16.0
        if self.augment and split == TRAIN:
            for i, sample_id in enumerate(rows["id"]):
                dy, dx = sample_rng(seed, epoch, int(sample_id)).integers(-1, 2, size=2)
                small[i] = np.roll(small[i], (int(dy), int(dx)), axis=(0, 1))
        big = F.interpolate(
            torch.from_numpy(small)[:, None],
            size=self.image_size,
            mode="bilinear",
            align_corners=False,
        )
        images = ((big - 0.5) / 0.5).expand(-1, 3, -1, -1)
        return images.contiguous().numpy()


class SyntheticDataset(ImageDataset):
    """Generated images of any size and class count, for throughput work. Each image is its
    class's colour plus per-sample noise, so models do learn; an image depends only on its id."""

    def __init__(
        self,
        num_samples: int = 4096,
        num_val_samples: int = 512,
        image_size: int = 64,
        num_classes: int = 10,
        noise: float = 0.5,
        data_seed: int = 0,
    ) -> None:
        self.check_args(
            num_samples=num_samples,
            num_val_samples=num_val_samples,
            image_size=image_size,
            num_classes=num_classes,
        )
        self.num_samples = num_samples
        self.num_val_samples = num_val_samples
        self.image_size = image_size
        self._num_classes = num_classes
        self.noise = noise
        self.data_seed = data_seed

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        for key in ("num_samples", "num_val_samples", "image_size"):
            _dataset_rule(kwargs[key] >= 1, key, kwargs, "must be >= 1")
        _dataset_rule(kwargs["num_classes"] >= 2, "num_classes", kwargs, "must be >= 2")

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def catalog(self, split: str) -> pa.Table:
        n = self.num_samples if split == TRAIN else self.num_val_samples
        offset = 0 if split == TRAIN else self.num_samples  # val ids never collide with train ids
        labels = np.random.default_rng([self.data_seed, offset]).integers(
            0, self._num_classes, size=n
        )
        return pa.table(
            {
                "id": np.arange(n, dtype=np.int64),
                "label": labels.astype(np.int64),
                "key": np.arange(offset, offset + n, dtype=np.int64),
            }
        )

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        size, n = self.image_size, len(rows["key"])
        palette = np.random.default_rng([self.data_seed, 7]).uniform(
            -1, 1, size=(self._num_classes, 3)
        )
        out = np.empty((n, 3, size, size), dtype=np.float32)
        for i, (key, label) in enumerate(zip(rows["key"], rows["label"], strict=True)):
            noise = np.random.default_rng([self.data_seed, int(key)]).random(
                (3, size, size), dtype=np.float32
            )
            out[i] = palette[label].reshape(3, 1, 1) + self.noise * (2 * noise - 1)
        return out


class ImageFolderDataset(ImageDataset):
    """A class-per-folder image tree at ``path`` (``{path}/{train_dir}/{class}/*.jpg`` and the
    same under ``val_dir``) on any fsspec URL: a local path, ``s3://bucket/prefix``, ``gs://...``.

    Files are listed once on the driver; reading and decoding happen in Ray Data tasks. Train
    images get a random resized crop and horizontal flip drawn from ``(seed, epoch, id)``;
    validation images are resized and centre-cropped.
    """

    def __init__(
        self,
        path: str,
        train_dir: str = TRAIN,
        val_dir: str = VAL,
        image_size: int = 224,
        resize_size: int = 256,
        augment: bool = True,
        num_classes: int | None = None,
        mean: tuple[float, ...] = (0.5, 0.5, 0.5),
        std: tuple[float, ...] = (0.5, 0.5, 0.5),
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.check_args(
            image_size=image_size,
            resize_size=resize_size,
            num_classes=num_classes,
            mean=mean,
            std=std,
        )
        self.path = str(path).rstrip("/")
        self.train_dir, self.val_dir = train_dir, val_dir
        self.image_size, self.resize_size = image_size, resize_size
        self.augment = augment
        self.declared_classes = num_classes
        self.mean, self.std = tuple(mean), tuple(std)
        self.storage_options = dict(storage_options or {})
        self._classes: list[str] | None = None
        self._listings: dict[str, dict[str, list[str]]] = {}
        self._fs: Any = None

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        for key in ("image_size", "resize_size"):
            _dataset_rule(kwargs[key] >= 1, key, kwargs, "must be >= 1 pixel")
        _dataset_rule(
            kwargs["resize_size"] >= kwargs["image_size"],
            "resize_size",
            kwargs,
            f"must be >= dataset.image_size ({kwargs['image_size']}): validation images are "
            "resized to it, then centre-cropped to image_size",
        )
        classes = kwargs.get("num_classes")
        _dataset_rule(
            classes is None or classes >= 2,
            "num_classes",
            kwargs,
            "must be >= 2, or null to count the class folders",
        )
        for key in ("mean", "std"):
            _dataset_rule(
                len(kwargs[key]) == 3, key, kwargs, "must have 3 values, one per RGB channel"
            )
        _dataset_rule(all(v > 0 for v in kwargs["std"]), "std", kwargs, "every value must be > 0")

    def __getstate__(self) -> dict[str, Any]:
        # Filesystem clients are per process; listings stay on the driver (they can be large).
        return {**self.__dict__, "_fs": None, "_listings": {}}

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs, _ = fsspec.core.url_to_fs(self.path, **self.storage_options)
        return self._fs

    def _root(self, split: str) -> str:
        _, root = fsspec.core.url_to_fs(self.path, **self.storage_options)
        return posixpath.join(root, self.train_dir if split == TRAIN else self.val_dir)

    def _list(self, split: str) -> dict[str, list[str]]:
        if split not in self._listings:
            self._listings[split] = self._scan(split)
        return self._listings[split]

    def _scan(self, split: str) -> dict[str, list[str]]:
        root = self._root(split)
        try:
            files = self.fs.find(root)
        except FileNotFoundError:
            files = []
        by_class: dict[str, list[str]] = {}
        for f in sorted(files):
            rel = posixpath.relpath(f, root)
            parts = rel.split("/")
            if len(parts) == 2 and parts[1].lower().endswith(IMAGE_EXTENSIONS):
                by_class.setdefault(parts[0], []).append(f)
        if not by_class:
            raise FileNotFoundError(
                f"dataset.path={self.path!r}: no images under {split} folder {root!r}; expected "
                f"{self.path}/{self.train_dir if split == TRAIN else self.val_dir}/<class>/<image>.jpg"
            )
        return by_class

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            self._classes = sorted(self._list(TRAIN))
            if self.declared_classes is not None and len(self._classes) != self.declared_classes:
                raise ValueError(
                    f"dataset.num_classes={self.declared_classes}: {self.path!r} has "
                    f"{len(self._classes)} class folders under {self.train_dir}/"
                )
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)  # checked against dataset.num_classes when that is set

    def catalog(self, split: str) -> pa.Table:
        index = {name: i for i, name in enumerate(self.classes)}
        listing = self._list(split)
        unknown = sorted(set(listing) - set(index))
        if unknown:
            raise ValueError(
                f"dataset.path={self.path!r}: {split} has classes not in train: {unknown[:5]}"
            )
        paths = [p for name in sorted(listing) for p in listing[name]]
        labels = [index[name] for name in sorted(listing) for _ in listing[name]]
        return pa.table(
            {
                "id": np.arange(len(paths), dtype=np.int64),
                "label": np.asarray(labels, dtype=np.int64),
                "path": paths,
            }
        )

    def _crop_box(self, width: int, height: int, rng: np.random.Generator) -> tuple[float, ...]:
        """torchvision's RandomResizedCrop box (scale 0.08-1, ratio 3/4-4/3), from ``rng``."""
        area = width * height
        for _ in range(10):
            target = area * rng.uniform(0.08, 1.0)
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            w, h = round(np.sqrt(target * ratio)), round(np.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
                return (left, top, left + w, top + h)
        side = min(width, height)
        return ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)

    def _transform(self, data: bytes, train: bool, rng: np.random.Generator) -> np.ndarray:
        from PIL import Image

        size = self.image_size
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if train and self.augment:
                box = self._crop_box(width, height, rng)
                # A large JPEG decodes at 1/2, 1/4 or 1/8 scale when the crop still has
                # `size` pixels a side at that scale: the box is scaled to match.
                shrink = min(box[2] - box[0], box[3] - box[1]) / size
                img, factor = _draft(img, shrink)
                w, h = img.size
                box = tuple(
                    min(v * factor, edge) for v, edge in zip(box, (w, h, w, h), strict=True)
                )
                out = img.convert("RGB").resize((size, size), Image.BILINEAR, box=box)
                if rng.random() < 0.5:
                    out = out.transpose(Image.FLIP_LEFT_RIGHT)
            else:
                img, _ = _draft(img, min(width, height) / self.resize_size)
                img = img.convert("RGB")
                w, h = img.size
                scale = self.resize_size / min(w, h)
                img = img.resize(
                    (max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR
                )
                w, h = img.size
                left, top = (w - size) // 2, (h - size) // 2
                out = img.crop((left, top, left + size, top + size))
        return np.asarray(out, dtype=np.uint8)

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        train = split == TRAIN
        paths = [str(p) for p in rows["path"]]
        contents = self.fs.cat(paths)  # concurrent on object stores; keyed by path
        images = np.stack(
            [
                self._transform(contents[p], train, sample_rng(seed, epoch, int(i)))
                for p, i in zip(paths, rows["id"], strict=True)
            ]
        )
        return np.ascontiguousarray(images.transpose(0, 3, 1, 2))  # uint8 NCHW

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return self.mean, self.std

    def describe(self) -> str:
        return f"ImageFolderDataset({self.path})"


def build_dataset(node: dict[str, Any]) -> ImageDataset:
    """Instantiate ``dataset._target_`` and check it is an :class:`ImageDataset`."""
    from hydra.utils import instantiate

    dataset = instantiate(node, _convert_="all")
    if not isinstance(dataset, ImageDataset):
        raise TypeError(
            f"dataset._target_={node.get('_target_')!r} built a {type(dataset).__name__}, "
            "not an ftjob.datasets.ImageDataset subclass"
        )
    return dataset
