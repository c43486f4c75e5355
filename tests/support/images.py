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
