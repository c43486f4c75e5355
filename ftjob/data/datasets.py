"""Image datasets: a catalog of samples (built once, on the driver) and a decode step (run in
Ray Data tasks).

A dataset is split into a *catalog* -- a small Arrow table with one row per sample, ``id`` equal
to the row index and ``label`` -- and :meth:`ImageDataset.decode`, which turns catalog rows into
image tensors. Sample order, sharding and resumption work on catalog ids only
(:mod:`ftjob.data.streams`), so nothing is read or decoded to skip ahead. Any randomness in ``decode``
comes from ``(seed, epoch, id)``, so a sample looks the same whichever attempt decodes it.

Your own dataset: subclass :class:`ImageDataset` and point ``dataset._target_`` at it.
"""

from __future__ import annotations

import inspect
import io
import math
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from ftjob.config import ConfigError
from ftjob.data.bad_files import MAX_BAD_FRACTION
from ftjob.data.folders import (
    check_same_classes,
    is_local,
    list_split,
    names,
)
from ftjob.data.order import EpochPlan, ShuffleWindows

TRAIN, VAL = "train", "val"
BAD_FILES = ("fail", "skip")  # dataset.bad_files: what a file that does not decode does
# PIL's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS), made a stated setting.
MAX_IMAGE_PIXELS = 89_478_485
GONE = "gone"  # catalog column: rows whose file was removed since the run started
GONE_REASON = "removed from the dataset since the run started"
# Catalog schema metadata: the catalog's fingerprint (JSON) as its dataset states it -- its
# sources, shard by shard -- kept in every checkpoint instead of a hash of every column.
SOURCES = b"ftjob.sources"


class DataError(RuntimeError):
    """A dataset file that cannot be read or decoded. Deterministic: the same file fails again
    on every attempt, so the job ends at once (the run's one-line error), instead of spending
    ``failure.max_failures`` on restarts that would meet it again -- unless
    ``dataset.bad_files=skip``, where the sample is skipped instead (:meth:`decode_batch`)."""


@dataclass(frozen=True)
class BadFile:
    """A file that is not a sample, and why (one line)."""

    path: str
    reason: str


@dataclass
class Encoded:
    """Catalog rows as their encoded images, read for a decoder that may be elsewhere (the
    training device: :mod:`ftjob.data.device_decode`). ``data[k]``: row k's bytes, the error
    its read met (raised as a bad file, or again, by :meth:`ImageFolderDataset.decode_encoded`),
    or None where ``skipped[k]`` -- a row skipped unread (removed since the run started, no
    label). ``names[k]``: the file as the dataset's messages name it."""

    data: list[Any]
    skipped: np.ndarray
    names: list[str]


def data_error_of(exc: BaseException | None) -> DataError | None:
    """The :class:`DataError` behind ``exc``, if any: raised as it is (the first window decodes
    in the training process), or on its way from a Ray Data decode task. There it becomes the
    ``__cause__`` of Ray Data's ``UserCodeException``, the ``cause`` of a ``RayTaskError`` --
    and only a line of the task's traceback once through the object store (a pickled
    exception keeps no ``__cause__``): then it is rebuilt from that line."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # RayTaskError; as_instanceof_cause() is both
        if isinstance(e, DataError) and not isinstance(cause, BaseException):
            return e
        if _is_ray_task_error(e):
            for line in str(e).splitlines():
                if line.startswith(_DATA_ERROR_LINE):
                    return DataError(line[len(_DATA_ERROR_LINE) :])
        todo.extend(c for c in (e.__context__, e.__cause__, cause) if isinstance(c, BaseException))
    return None


_DATA_ERROR_LINE = f"{DataError.__module__}.{DataError.__qualname__}: "


def _is_ray_task_error(exc: BaseException) -> bool:
    from ray.exceptions import RayTaskError

    return isinstance(exc, RayTaskError)


def _dataset_rule(ok: bool, key: str, args: dict[str, Any], rule: str) -> None:
    if not ok:
        value = args[key]
        raise ConfigError(
            f"dataset.{key}", list(value) if isinstance(value, tuple) else value, rule
        )


def check_bad_file_args(kwargs: dict[str, Any]) -> None:
    """``dataset.bad_files``, ``dataset.max_bad_fraction`` and ``dataset.max_image_pixels``,
    for datasets that read files."""
    kwargs.setdefault("bad_files", "fail")
    _dataset_rule(
        kwargs["bad_files"] in BAD_FILES,
        "bad_files",
        kwargs,
        "must be fail (a file that does not decode ends the run, naming it) or skip (it is "
        "left out of every epoch, and listed in summary.json)",
    )
    pixels = kwargs.setdefault("max_image_pixels", MAX_IMAGE_PIXELS)
    whole = isinstance(pixels, int) and not isinstance(pixels, bool)
    _dataset_rule(
        pixels is None or (whole and pixels >= 1),
        "max_image_pixels",
        kwargs,
        "must be a whole number of pixels >= 1 (width x height; a larger image is a bad "
        "file, as a decompression bomb would be), or null for no limit",
    )
    fraction = kwargs.setdefault("max_bad_fraction", MAX_BAD_FRACTION)
    number = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
    _dataset_rule(
        number and 0 <= fraction <= 1,
        "max_bad_fraction",
        kwargs,
        f"must be a fraction from 0 to 1 (e.g. {MAX_BAD_FRACTION}): the share of a split's "
        "samples dataset.bad_files=skip may skip before the run fails; 1 = no limit",
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

    bad_files = "fail"  # dataset.bad_files, for datasets that read files
    max_bad_fraction = MAX_BAD_FRACTION  # dataset.max_bad_fraction (ftjob.data.bad_files)

    def decode_batch(
        self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`decode`, and which rows were skipped (``dataset.bad_files=skip``: a file
        that does not decode; its image is blank and never trained on). The same rows are
        skipped whichever attempt, rank or process decodes them: positions in the data order
        never shift, a skipped sample is seen-and-skipped at its place."""
        images = self.decode(rows, split, epoch, seed)
        return images, np.zeros(len(images), dtype=bool)

    def bad_file(self, row: dict[str, Any]) -> BadFile:
        """Which file a skipped catalog row is, and why it did not decode (read again: a
        skip is rare, its reason is not carried through the decode tasks)."""
        return BadFile(f"sample {row.get('id')}", "did not decode")

    def encoded(self, rows: dict[str, np.ndarray], split: str, epoch: int) -> Encoded | None:
        """The rows' encoded images, for ``trainer.decode_in=device`` (decoded on the training
        device); None: this dataset has none to hand over (it makes its images in
        :meth:`decode`)."""
        return None

    def on_device(
        self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int, device: Any
    ) -> Any:
        """The rows' images made on the training ``device`` (a tensor, as :meth:`decode`
        makes them), for ``trainer.decode_in=device``; None where this dataset cannot."""
        return None

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel (mean, std), in units of the full 0..1 range, that uint8 images from
        :meth:`decode` are normalised with on the device; None for float32 images."""
        return None

    def describe(self) -> str:
        return type(self).__name__

    def catalog_notes(self) -> list[str]:
        """One-line notes about the catalogs for the driver to print (files that are not
        samples, and why); empty when there is nothing to say."""
        return []

    def shuffle_windows(self, catalog: pa.Table) -> ShuffleWindows | None:
        """How the epoch order shuffles the samples of ``catalog`` (the training split):
        None -- any sample anywhere; row-grouped data -- within windows of row groups."""
        return None

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        """Refuse constructor arguments that could only fail later, inside decode tasks on the
        cluster (raise :class:`~ftjob.config.ConfigError` naming ``dataset.KEY``). Called with
        every argument, defaults included, by config validation and ``python -m ftjob.check``:
        it must not read any data."""
        return None


def epoch_plan(dataset: ImageDataset, catalog: pa.Table, trainer: Any) -> EpochPlan:
    """The data order of the training split ``catalog`` (``trainer``: its global batch size
    and seed), the same on the driver and every worker."""
    windows = dataset.shuffle_windows(catalog)
    return EpochPlan(catalog.num_rows, trainer.global_batch_size, trainer.seed, windows)


def _draft(img: Any, shrink: float) -> tuple[Any, float]:
    """``img`` set to decode at a reduced scale (JPEG only: PIL's draft mode) that keeps at
    least ``1/shrink`` of its size, and the scale it got: 1/2, 1/4, 1/8, or 1.0 for none."""
    if shrink < 2 or img.format != "JPEG":
        return img, 1.0
    width = img.size[0]
    img.draft("RGB", (math.ceil(img.size[0] / shrink), math.ceil(img.size[1] / shrink)))
    # The reduced size is rounded up (1001 px at 1/2: 501), so the scale is the power of two.
    return img, 1.0 / round(width / img.size[0])


ORIENTATION = 0x0112  # EXIF: how the stored pixels turn to show the picture upright
TURNED = (5, 6, 7, 8)  # orientations that swap width and height


def _orientation(img: Any) -> int:
    """The EXIF orientation of an opened image (1: stored upright). Reading it does not decode
    a JPEG's pixels, so draft mode can still be set afterwards."""
    try:
        return int(img.getexif().get(ORIENTATION, 1))
    except (TypeError, ValueError):  # an unreadable tag: the pixels as stored
        return 1


def _upright(img: Any, orientation: int) -> Any:
    """``img`` turned as its EXIF orientation says (this decodes it: after any draft)."""
    if orientation not in range(2, 9):
        return img
    from PIL import ImageOps

    return ImageOps.exif_transpose(img)


def _rgb(img: Any) -> Any:
    """``img`` as 8-bit RGB. PIL's own conversion clips 16-bit grey (modes ``I;16*``, and ``I``
    holding values above 255) to 255 -- a white image -- so those are scaled to 8 bit first
    (the high byte). Palette, grey, alpha, CMYK and 1-bit images convert as PIL does (alpha
    dropped); PIL already reads 16-bit RGB(A) PNGs as 8 bit."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode == "I":
        from PIL import Image

        values = np.asarray(img)
        if mode == "I" and values.max(initial=0) <= 255:
            values = np.clip(values, 0, 255)  # 8-bit data in a 32-bit container
        else:
            values = np.clip(values, 0, 65535) >> 8
        img = Image.fromarray(values.astype(np.uint8))  # mode L
    return img.convert("RGB")


def _reason(exc: BaseException) -> str:
    """Why a file did not decode, on one line (PIL's own message names a BytesIO object)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "UnidentifiedImageError: no image format PIL reads recognises its bytes"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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

        stacked = np.stack([np.frombuffer(p, dtype=np.uint8).reshape(8, 8) for p in rows["pixels"]])
        small = stacked.astype(np.float32) / 16.0
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
        keys, labels = np.asarray(rows["key"], np.int64), np.asarray(rows["label"], np.int64)
        noise = self._noise(np, keys, np.arange(3 * self.image_size**2)).astype(np.float32)
        return self._palette()[labels][:, :, None, None] + noise * np.float32(self.noise)

    def on_device(
        self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int, device: Any
    ) -> Any:
        """The same images as :meth:`decode`, bit for bit, made on ``device``: nothing but
        the ids crosses to it (``dataset=synthetic`` with ``trainer.decode_in=device``)."""
        import torch

        keys = torch.as_tensor(np.asarray(rows["key"], np.int64), device=device)
        labels = torch.as_tensor(np.asarray(rows["label"], np.int64), device=device)
        pixels = torch.arange(3 * self.image_size**2, device=device)
        noise = self._noise(torch, keys, pixels).float()
        colours = torch.from_numpy(self._palette()).to(device)
        return colours[labels][:, :, None, None] + noise * self.noise

    def _palette(self) -> np.ndarray:
        rng = np.random.default_rng([self.data_seed, 7])
        return rng.uniform(-1, 1, size=(self._num_classes, 3)).astype(np.float32)

    def _noise(self, xp: Any, keys: Any, pixels: Any) -> Any:
        """Each image's noise in [-1, 1), (N, 3, size, size): 24 bits of a counter-based hash
        of (data_seed, key, pixel) in 32-bit integers, as multiples of 2**-23 -- the same
        numbers in numpy (``xp``) and torch on any device, so each image the same floats
        wherever it is made."""
        seed = _mix(self.data_seed & _MASK)
        bits = _mix(((_mix(keys & _MASK ^ seed))[:, None] + pixels[None, :]) & _MASK) >> 8
        size = self.image_size
        return bits.reshape(len(keys), 3, size, size) * 2.0**-23 - 1.0


_MASK = 0xFFFFFFFF  # 32-bit words in int64: products stay below 2**63 on every device
_MIX = 0x45D9F3B


def _mix(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply, two rounds) of ``x`` (an int, or every
    element of an int64 array or tensor)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK
    x = (((x >> 16) ^ x) * _MIX) & _MASK
    return (x >> 16) ^ x


class ImageFolderDataset(ImageDataset):
    """A class-per-folder image tree at ``path`` (``{path}/{train_dir}/{class}/.../*.jpg`` and
    the same under ``val_dir``) on any fsspec URL: a local path, ``s3://bucket/prefix``,
    ``gs://...``. As in torchvision's ImageFolder, every image file at any depth under a class
    folder is a sample of that class. Hidden files and folders (a name starting with ``.``:
    macOS's ``._x.jpg`` AppleDouble files, ``.DS_Store``...) are not samples, nor are files
    directly in the split folder; :meth:`catalog_notes` says what was left out.

    Files are listed once on the driver; reading and decoding happen in Ray Data tasks, each
    file read by its exact name (never glob-expanded). Images are turned upright by their EXIF
    orientation; train images get a random resized crop and horizontal flip drawn from
    ``(seed, epoch, id)``; validation images are resized and centre-cropped. A file that
    cannot be read or decoded, or has more than ``max_image_pixels`` pixels, raises
    :class:`DataError` naming it (``bad_files=fail``), or is skipped in every epoch
    (``bad_files=skip``). A local file that is a link to outside ``path`` is not a sample:
    nothing is read from outside the dataset's root.

    The tree is audited when it is listed, before anything trains: a class folder without
    images, a validation split whose classes are not the training split's, and a class count
    other than ``num_classes`` are refused by name.
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
        bad_files: str = "fail",
        max_image_pixels: int | None = MAX_IMAGE_PIXELS,
        follow_links: bool = False,
        max_bad_fraction: float = MAX_BAD_FRACTION,
    ) -> None:
        self.follow_links = bool(follow_links)
        ImageFolderDataset.check_args(  # the image keys' rules; a subclass checks its own keys
            image_size=image_size,
            resize_size=resize_size,
            num_classes=num_classes,
            mean=mean,
            std=std,
            bad_files=bad_files,
            max_image_pixels=max_image_pixels,
            max_bad_fraction=max_bad_fraction,
        )
        self.bad_files, self.max_image_pixels = bad_files, max_image_pixels
        self.max_bad_fraction = float(max_bad_fraction)
        self.path = str(path).rstrip("/")
        self.train_dir, self.val_dir = train_dir, val_dir
        self.image_size, self.resize_size = image_size, resize_size
        self.augment = augment
        self.declared_classes = num_classes
        self.mean, self.std = tuple(mean), tuple(std)
        self.storage_options = dict(storage_options or {})
        self._classes: list[str] | None = None
        self._listings: dict[str, dict[str, list[str]]] = {}
        self._notes: dict[str, list[str]] = {}  # per split, from its listing
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
        check_bad_file_args(kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # Filesystem clients are per process; listings stay on the driver (they can be large).
        return {**self.__dict__, "_fs": None, "_listings": {}, "_notes": {}}

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
        folder = self.train_dir if split == TRAIN else self.val_dir
        _, base = fsspec.core.url_to_fs(self.path, **self.storage_options)
        root = self._root(split)
        listing = list_split(self.fs, root, folder, self.path, base, self.follow_links)
        self._notes[split] = listing.notes
        if not listing.by_class:
            raise FileNotFoundError(
                f"dataset.path={self.path!r}: no images under {split} folder {root!r}; expected "
                f"{self.path}/{folder}/<class>/<image>.jpg"
            )
        return listing.by_class

    def catalog_notes(self) -> list[str]:
        notes: list[str] = []
        for split in (TRAIN, VAL):
            self._list(split)  # listed once: its notes come with the listing
            notes.extend(self._notes.get(split, []))
        return notes

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            classes = sorted(self._list(TRAIN))
            if self.declared_classes is not None and len(classes) != self.declared_classes:
                raise ConfigError(
                    "dataset.num_classes",
                    self.declared_classes,
                    f"{self.path} has {len(classes)} class folders under {self.train_dir}/ "
                    f"({names(classes)}): set dataset.num_classes={len(classes)}, or null to "
                    "count them, or fix the tree",
                )
            self._classes = classes
        return self._classes

    @property
    def num_classes(self) -> int:
        return len(self.classes)  # checked against dataset.num_classes when that is set

    def catalog(self, split: str) -> pa.Table:
        index = {name: i for i, name in enumerate(self.classes)}
        listing = self._list(split)
        if split == VAL:
            check_same_classes(
                self.path, self.classes, sorted(listing), self.train_dir, self.val_dir
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
        with _open_image(data, self.max_image_pixels) as img:
            orientation = _orientation(img)
            width, height = img.size
            if orientation in TURNED:  # the crop is drawn on the upright picture
                width, height = height, width
            if train and self.augment:
                box = self._crop_box(width, height, rng)
                # A large JPEG decodes at 1/2, 1/4 or 1/8 scale when the crop still has
                # `size` pixels a side at that scale: the box is scaled to match. Draft
                # first (it only scales), then turn upright: the box fits the turned size.
                shrink = min(box[2] - box[0], box[3] - box[1]) / size
                img, factor = _draft(img, shrink)
                img = _upright(img, orientation)
                w, h = img.size
                box = tuple(
                    min(v * factor, edge) for v, edge in zip(box, (w, h, w, h), strict=True)
                )
                out = _rgb(img).resize((size, size), Image.Resampling.BILINEAR, box=box)
                if rng.random() < 0.5:
                    out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            else:
                img, _ = _draft(img, min(width, height) / self.resize_size)
                img = _rgb(_upright(img, orientation))
                w, h = img.size
                scale = self.resize_size / min(w, h)
                img = img.resize(
                    (max(size, round(w * scale)), max(size, round(h * scale))),
                    Image.Resampling.BILINEAR,
                )
                w, h = img.size
                left, top = (w - size) // 2, (h - size) // 2
                out = img.crop((left, top, left + size, top + size))
        return np.asarray(out, dtype=np.uint8)

    def _url(self, path: str) -> str:
        """A listed path as the user would write it (``s3://bucket/key``; local: the path)."""
        return path if is_local(self.fs) else self.fs.unstrip_protocol(path)

    def _image(self, path: str, data: Any, train: bool, rng: np.random.Generator) -> np.ndarray:
        if isinstance(data, BaseException):
            if isinstance(data, (FileNotFoundError, PermissionError)):  # so on every attempt
                raise DataError(
                    f"dataset file {self._url(path)} cannot be read ({_reason(data)}): it was "
                    "listed when the catalog was built; restore it, or remove it and start a "
                    "new run"
                ) from data
            raise OSError(f"dataset file {self._url(path)}: {_reason(data)}") from data
        fix = "remove or fix it (then resume=true), or set dataset.bad_files=skip"
        return self._decoded(data, train, rng, f"dataset file {self._url(path)}", fix)

    def _decoded(
        self, data: bytes, train: bool, rng: np.random.Generator, where: str, fix: str
    ) -> np.ndarray:
        """``data`` decoded and transformed. It is bytes in memory, so a failure is the same on
        every attempt: a :class:`DataError` naming ``where`` the bytes came from and the fix."""
        try:
            return self._transform(data, train, rng)
        except MemoryError:
            raise
        except Exception as exc:
            raise DataError(
                f"{where} cannot be decoded as an image ({_reason(exc)}): {fix}"
            ) from exc

    def decode(self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int) -> np.ndarray:
        return self.decode_batch(rows, split, epoch, seed)[0]

    def encoded(self, rows: dict[str, np.ndarray], split: str, epoch: int) -> Encoded:
        paths = [str(p) for p in rows["path"]]
        # A row whose file was removed since the run started keeps its place: never read.
        gone = rows.get(GONE)
        skipped = np.zeros(len(paths), bool) if gone is None else np.asarray(gone, bool).copy()
        # Exactly these files: fs.cat would glob-expand each path ("photo[1].jpg" reads
        # photo1.jpg). cat_ranges reads them concurrently on object stores (async
        # filesystems), one by one on local disk; a file's error comes back in its place.
        read = [p for p, g in zip(paths, skipped, strict=True) if not g]
        contents = iter(self.fs.cat_ranges(read, None, None, on_error="return") if read else [])
        return Encoded([None if g else next(contents) for g in skipped], skipped, paths)

    def decode_encoded(self, data: Any, name: str, train: bool, rng: np.random.Generator) -> Any:
        """One row's encoded image (or the error its read met) decoded on the CPU, as
        :meth:`decode_batch` decodes it: a :class:`DataError` naming ``name`` where it is a
        bad file."""
        return self._image(name, data, train, rng)

    def decode_batch(
        self, rows: dict[str, np.ndarray], split: str, epoch: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        return decode_rows(self, self.encoded(rows, split, epoch), rows["id"], split, epoch, seed)

    def check_file(self, path: str) -> str | None:
        """Why one listed file cannot be a sample (read and decoded as validation decodes
        it), or None: ``python -m ftjob.check --data``, and the reason a skip is listed with."""
        try:
            data: Any = self.fs.cat_file(path)  # one exact path: never glob-expanded
        except Exception as exc:  # noqa: BLE001 -- judged as decode judges a failed read
            data = exc
        try:
            self._image(path, data, False, np.random.default_rng(0))
        except DataError as exc:
            cause = exc.__cause__
            return _reason(cause) if cause is not None else str(exc)
        except OSError as exc:  # a read that may succeed when tried again
            return f"not read: {_reason(exc)}"
        return None

    def bad_file(self, row: dict[str, Any]) -> BadFile:
        path = str(row["path"])
        if row.get(GONE):
            return BadFile(self._url(path), GONE_REASON)
        return BadFile(self._url(path), self.check_file(path) or "did not decode")

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return self.mean, self.std

    def describe(self) -> str:
        return f"ImageFolderDataset({self.path})"


def with_keys_of(
    init: Callable[..., None], base: Callable[..., None], drop: tuple[str, ...] = ()
) -> inspect.Signature:
    """The keys of a constructor that passes ``**kwargs`` on to ``base`` (its base class's
    constructor): its own, then each of the base's it does not name, keyword-only -- all but
    ``drop``. What the class's ``__signature__`` says it takes, one list of the shared keys."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in own} | set(drop)
    passed = [
        p.replace(kind=p.KEYWORD_ONLY)
        for p in inspect.signature(base).parameters.values()
        if p.name not in named and p.kind is not p.VAR_KEYWORD
    ]
    return inspect.Signature([p for p in own if p.name != "self"] + passed)


def decode_rows(
    dataset: ImageFolderDataset,
    encoded: Encoded,
    ids: np.ndarray,
    split: str,
    epoch: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Encoded rows decoded on the CPU (:meth:`ImageFolderDataset.decode_encoded`), uint8
    NCHW, and which were skipped: unread ones, and under ``dataset.bad_files=skip`` those that
    do not decode -- the same rows whichever attempt, rank or process decodes them."""
    train, size = split == TRAIN, dataset.image_size
    skipped = encoded.skipped.copy()
    images = np.zeros((len(skipped), size, size, 3), dtype=np.uint8)
    for k, (data, name, i) in enumerate(zip(encoded.data, encoded.names, ids, strict=True)):
        if skipped[k]:
            continue
        try:
            images[k] = dataset.decode_encoded(data, name, train, sample_rng(seed, epoch, int(i)))
        except DataError:
            if dataset.bad_files != "skip":
                raise
            skipped[k] = True  # the same file fails the same way on every attempt
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2)), skipped  # uint8 NCHW


class ImageTooLarge(ValueError):
    """An image with more pixels than ``dataset.max_image_pixels``."""


def _open_image(data: bytes, max_pixels: int | None) -> Any:
    """``data`` opened by PIL (its header read, no pixels), refused when it has more than
    ``max_pixels`` pixels (``dataset.max_image_pixels``). It replaces PIL's own check, which
    reads the process-wide ``Image.MAX_IMAGE_PIXELS`` (a warning above it, an error only above
    twice it): in a process that decodes -- the training workers, Ray Data's decode tasks --
    that one is turned off, and the dataset's limit applies exactly, the same everywhere."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    if max_pixels is not None and width * height > max_pixels:
        img.close()
        raise ImageTooLarge(
            f"{width}x{height} = {width * height} pixels, more than "
            f"dataset.max_image_pixels={max_pixels}"
        )
    return img


def build_dataset(node: dict[str, Any]) -> ImageDataset:
    """Instantiate ``dataset._target_`` and check it is an :class:`ImageDataset`."""
    from hydra.utils import instantiate

    dataset = instantiate(node, _convert_="all")
    if not isinstance(dataset, ImageDataset):
        raise TypeError(
            f"dataset._target_={node.get('_target_')!r} built a {type(dataset).__name__}, "
            "not an ftjob.data.datasets.ImageDataset subclass"
        )
    return dataset
