"""``python -m my_project.make_bars ROOT``: a small BarsDataset on disk -- PNG files of
horizontal or vertical bars on noise, and ``train.csv`` / ``val.csv`` that list them."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from my_project.data import CLASSES


def make_bars(root: Path, train: int = 512, val: int = 128, size: int = 24) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        folder = root / "images" / split
        folder.mkdir(parents=True, exist_ok=True)
        with open(root / f"{split}.csv", "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["file", "label"])
            for i in range(count):
                label = i % len(CLASSES)
                pixels = rng.normal(80, 30, (size, size))
                at = rng.integers(2, size - 2)
                if CLASSES[label] == "horizontal":
                    pixels[at - 1 : at + 1, :] += 120
                else:
                    pixels[:, at - 1 : at + 1] += 120
                gray = np.clip(pixels, 0, 255).astype(np.uint8)
                name = f"images/{split}/{i:05d}.png"
                Image.fromarray(np.stack([gray] * 3, axis=-1)).save(root / name)
                out.writerow([name, CLASSES[label]])
    return root


if __name__ == "__main__":
    print(make_bars(Path(sys.argv[1] if len(sys.argv) > 1 else "data/bars")))
