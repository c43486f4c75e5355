"""Image trees on disk, written with PIL: class-per-folder PNGs, and trees with files that do not
decode."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from ftjob.data.datasets import TRAIN


def make_image_tree(
    root: Path, classes: int = 3, train_per_class: int = 24, val_per_class: int = 6, size: int = 20
) -> Path:
    """A real class-per-folder tree of PNG files: each class a colour, plus noise."""

    rng = np.random.default_rng(0)
    colours = rng.integers(40, 215, size=(classes, 3))
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(colours[c] + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(
                    np.uint8
                )
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return root


PER_CLASS = 23  # good training images per class; one bad file each makes 48 = 6 steps of 8


def write_images(root: Path, per_class: int = PER_CLASS, val: int = 4) -> None:
    """Two classes of 8x8 PNGs (dark and light, with noise: a model learns them)."""
    rng = np.random.default_rng(0)
    for split, n in ((TRAIN, per_class), ("val", val)):
        for name, level in (("a", 40), ("b", 200)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = np.clip(level + rng.normal(0, 20, (8, 8, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def truncated_png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()[:60]


def bad_tree(root: Path) -> dict[str, Path]:
    """Good images plus a zero-byte JPEG (class a) and a truncated PNG (class b): the last
    file of their class folders, so catalog ids 23 and 47."""
    write_images(root)
    bad = {"empty": root / TRAIN / "a" / "empty.jpg", "truncated": root / TRAIN / "b" / "trunc.png"}
    bad["empty"].write_bytes(b"")
    bad["truncated"].write_bytes(truncated_png())
    return bad


def digits_tree(root: Path) -> Path:
    """scikit-learn's digits as ``dataset=digits`` splits them (the same train/val rows), each
    an 8x8 PNG (0..16 scaled to 0..255) under ``{train,val}/<digit>/``: the digits run's images
    as files, for the image-file and Parquet layouts."""
    from ftjob.data.datasets import VAL, DigitsDataset

    digits = DigitsDataset()
    for split in (TRAIN, VAL):
        table = digits.catalog(split).to_pydict()
        for i, (label, raw) in enumerate(zip(table["label"], table["pixels"], strict=True)):
            small = np.frombuffer(raw, dtype=np.uint8).reshape(8, 8).astype(np.uint16)
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray((small * 255 // 16).astype(np.uint8)).save(folder / f"{i:04d}.png")
    return root


def photo_like(seed: int, width: int = 400, height: int = 350) -> np.ndarray:
    """An HxWx3 uint8 picture with a photograph's spread of detail (fine grain, edges and
    smooth areas at four scales): as a quality-90 JPEG at ImageNet's mean size, 400x350,
    about 110 KB -- what a decoder meets in ImageNet, not a flat test card."""
    rng = np.random.default_rng(seed)
    pixels = np.zeros((height, width, 3))
    for step, amplitude in ((1, 50), (3, 40), (12, 40), (48, 40)):
        small = rng.normal(0, 1, (height // step + 2, width // step + 2, 3))
        small = (small - small.min()) / np.ptp(small) * 255
        big = Image.fromarray(small.astype(np.uint8)).resize((width, height), Image.BICUBIC)
        pixels += (np.asarray(big, dtype=np.float64) - 128) / 128 * amplitude
    pixels += rng.normal(0, 55, (height, width, 1))
    return np.clip(128 + pixels, 0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, quality: int = 90, mode: str = "RGB", **options: object) -> bytes:
    """``pixels`` as JPEG bytes (``mode="CMYK"``: a 4-component Adobe JPEG; ``progressive=True``,
    ``exif=...`` as PIL takes them)."""
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="JPEG", quality=quality, **options)
    return out.getvalue()


def exif_orientation(orientation: int) -> bytes:
    """An EXIF block saying how the stored pixels turn to show the picture upright."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def photo_tree(
    root: Path, classes: int = 2, train_per_class: int = 6, val_per_class: int = 2
) -> Path:
    """A class-per-folder tree of ImageNet-like JPEGs (:func:`photo_like`, quality 90)."""
    for split, count in ((TRAIN, train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                seed = (0 if split == TRAIN else 10_000) + 100 * c + i
                (folder / f"{i:03d}.jpg").write_bytes(jpeg(photo_like(seed)))
    return root


def awkward_files(pixels: np.ndarray) -> dict[str, bytes]:
    """One file of each kind a batched device decoder is not for, and one no decoder reads:
    a PNG, a CMYK JPEG, a progressive JPEG and a truncated JPEG."""
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    whole = jpeg(pixels)
    return {
        "png": png.getvalue(),
        "cmyk": jpeg(pixels, mode="CMYK"),
        "progressive": jpeg(pixels, progressive=True),
        "truncated": whole[: len(whole) // 2],
    }
