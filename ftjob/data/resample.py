"""Pillow's bilinear resize, as tensors on any device: the same arithmetic, the same bytes.

The worker's decoder (:meth:`ImageFolderDataset._transform`) crops and resizes with PIL:
``resize(size, BILINEAR, box=...)`` for a training crop, ``resize`` then a centre crop for
validation. On the device the same picture must come out of a decoded batch, so this module
does what Pillow's ``Resample.c`` does: for each output pixel the taps of a triangle filter
widened by the downscale factor (antialiased), normalised, rounded to 22-bit fixed point;
a horizontal pass rounded to 8 bits, then a vertical one. Integer arithmetic is exact, so the
result is the same on the CPU and on a GPU, whatever the batch around an image: from the same
decoded pixels, the same bytes as PIL (``tests/unit/data/test_resample.py``).

The taps are drawn on the CPU (numpy, per sample, where its crop is drawn); the passes run on
the device over a batch: each image's span of rows and columns copied into one padded tensor,
then one gather-multiply-add per tap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

PRECISION_BITS = 22  # Pillow's fixed point for 8-bit images (Resample.c: 32 - 8 - 2)
ROUND = 1 << (PRECISION_BITS - 1)
# A chunk of a batch resized at once holds at most this many padded pixels (its int32 sums
# are four bytes each): a batch of large photos is resized in several chunks.
CHUNK_PIXELS = 48 * 2**20


def taps(in0: float, in1: float, size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's bilinear filter from ``[in0, in1)`` of an axis of ``size`` pixels to ``out``
    pixels: for each output pixel, the input indices it reads (``(out, K)``, int64) and their
    weights in 22-bit fixed point (``(out, K)``, int32; a padding tap weighs 0)."""
    scale = (in1 - in0) / out
    filterscale = max(scale, 1.0)
    support = filterscale  # the bilinear filter's support is 1, widened when downscaling
    center = in0 + (np.arange(out) + 0.5) * scale
    # C's (int) cast truncates toward zero; then clamped to the axis, as Pillow does.
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(center + support + 0.5), size).astype(np.int64)
    k = np.arange(int(math.ceil(support)) * 2 + 1)
    index = first[:, None] + k[None, :]
    valid = k[None, :] < (last - first)[:, None]
    weight = np.clip(1.0 - np.abs((index - center[:, None] + 0.5) / filterscale), 0.0, None)
    weight = np.where(valid, weight, 0.0)
    total = weight.sum(axis=1, keepdims=True)
    weight = weight / np.where(total == 0, 1.0, total)
    fixed = np.floor(0.5 + weight * (1 << PRECISION_BITS)).astype(np.int32)
    return np.where(valid, index, first[:, None]), fixed


@dataclass(frozen=True)
class Geometry:
    """One sample's picture from its decoded pixels: turned upright by its EXIF
    ``orientation``, rows ``y`` and columns ``x`` of the upright image read through their taps
    (indices relative to ``y0``/``x0``: the span copied to the batch), then flipped."""

    orientation: int
    y0: int
    y1: int
    x0: int
    x1: int
    yi: np.ndarray  # (out, Ky) int64, relative to y0
    yw: np.ndarray  # (out, Ky) int32
    xi: np.ndarray  # (out, Kx) int64, relative to x0
    xw: np.ndarray  # (out, Kx) int32
    flip: bool


def _span(index: np.ndarray, weight: np.ndarray) -> tuple[int, int, np.ndarray]:
    read = index[weight != 0]
    lo = int(read.min()) if read.size else 0
    hi = int(read.max()) + 1 if read.size else 1
    # A tap of weight 0 may lie outside [lo, hi): it is gathered all the same (one gather a tap
    # for the batch), so it is kept inside the span -- past it lies the next image or nothing.
    return lo, hi, np.clip(index - lo, 0, hi - lo - 1)


def geometry(
    box: tuple[float, ...],
    out: tuple[int, int],
    keep: tuple[int, int, int, int],
    orientation: int,
    flip: bool,
    upright: tuple[int, int],
) -> Geometry:
    """``box`` (left, top, right, bottom) of the ``upright`` (width, height) picture resized
    to ``out`` (width, height) pixels, of which the window ``keep`` (left, top, width,
    height) is kept: a training crop keeps all of it, validation its centre."""
    width, height = upright
    xi, xw = taps(box[0], box[2], width, out[0])
    yi, yw = taps(box[1], box[3], height, out[1])
    left, top, w, h = keep
    xi, xw = xi[left : left + w], xw[left : left + w]
    yi, yw = yi[top : top + h], yw[top : top + h]
    x0, x1, xi = _span(xi, xw)
    y0, y1, yi = _span(yi, yw)
    return Geometry(orientation, y0, y1, x0, x1, yi, yw, xi, xw, flip)


def train_geometry(
    upright: tuple[int, int], box: tuple[float, ...], size: int, orientation: int, flip: bool
) -> Geometry:
    """A training sample: its crop ``box`` resized to ``size`` x ``size``, maybe flipped."""
    width, height = upright
    box = tuple(min(v, edge) for v, edge in zip(box, (width, height, width, height), strict=True))
    return geometry(box, (size, size), (0, 0, size, size), orientation, flip, upright)


def val_geometry(
    upright: tuple[int, int], size: int, resize_size: int, orientation: int
) -> Geometry:
    """A validation sample: its short side resized to ``resize_size`` (each side at least
    ``size``), the centre ``size`` x ``size`` kept -- the arithmetic of the PIL path."""
    width, height = upright
    scale = resize_size / min(width, height)
    out = (max(size, round(width * scale)), max(size, round(height * scale)))
    left, top = (out[0] - size) // 2, (out[1] - size) // 2
    box = (0.0, 0.0, float(width), float(height))
    return geometry(box, out, (left, top, size, size), orientation, False, upright)


def upright(image: Any, orientation: int) -> Any:
    """A decoded ``(C, H, W)`` tensor turned as its EXIF orientation says (PIL's
    ``ImageOps.exif_transpose``: 2 mirrored, 3 turned half way, 4 upside down, 5 transposed,
    6 turned a quarter clockwise, 7 transversed, 8 a quarter anticlockwise)."""
    import torch

    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1).flip(-2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(image, -1, (-2, -1))
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return torch.rot90(image, 1, (-2, -1))
    return image


def resample(images: list[Any], geoms: list[Geometry], device: Any) -> Any:
    """Decoded ``(3, H, W)`` uint8 images (as stored: turned upright here) to a
    ``(N, 3, out, out)`` uint8 batch on ``device``, each through its geometry, in chunks of
    at most :data:`CHUNK_PIXELS` padded pixels."""
    import torch

    if not images:
        return None
    chunks: list[list[int]] = []
    chunk: list[int] = []
    peak = (0, 0)
    for k, g in enumerate(geoms):
        need = (max(peak[0], g.y1 - g.y0), max(peak[1], g.x1 - g.x0, len(g.xi)))
        if chunk and (len(chunk) + 1) * need[0] * need[1] > CHUNK_PIXELS:
            chunks.append(chunk)
            chunk, need = [], (g.y1 - g.y0, max(g.x1 - g.x0, len(g.xi)))
        chunk.append(k)
        peak = need
    chunks.append(chunk)
    parts = [_resample([images[k] for k in c], [geoms[k] for k in c], device) for c in chunks]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _pass(planes: Any, index: Any, weight: Any) -> Any:
    """One resize pass over ``planes`` (n, L, ...): for each image and output position, the
    weighted sum of its taps along L, in Pillow's fixed point, rounded and clipped to 8 bits
    (``(n, out, ...)`` int32). Rows of all images are taken by one ``index_select`` a tap."""
    import torch

    n, length = planes.shape[:2]
    rest = planes.shape[2:]
    flat = planes.reshape(n * length, -1)
    out = index.shape[1]
    base = (torch.arange(n, device=flat.device) * length)[:, None]
    acc = torch.full((n * out, flat.shape[1]), ROUND, dtype=torch.int32, device=flat.device)
    for k in range(index.shape[2]):
        taken = flat.index_select(0, (base + index[:, :, k]).reshape(-1)).to(torch.int32)
        acc += taken * weight[:, :, k].reshape(-1, 1)
    return (acc >> PRECISION_BITS).clamp_(0, 255).reshape(n, out, *rest)


def _stacked(arrays: list[np.ndarray], dtype: Any, device: Any) -> Any:
    """``(N, out, K)`` of per-image ``(out, K_i)`` tap arrays, padded with weight-0 taps."""
    import torch

    width = max(a.shape[1] for a in arrays)
    out = np.zeros((len(arrays), arrays[0].shape[0], width), dtype=arrays[0].dtype)
    for n, a in enumerate(arrays):
        out[n, :, : a.shape[1]] = a
    host = torch.from_numpy(out).to(dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _resample(images: list[Any], geoms: list[Geometry], device: Any) -> Any:
    import torch

    n = len(images)
    h = max(g.y1 - g.y0 for g in geoms)
    w = max(g.x1 - g.x0 for g in geoms)
    span = torch.zeros((n, 3, h, w), dtype=torch.uint8, device=device)
    for k, (image, g) in enumerate(zip(images, geoms, strict=True)):
        picture = upright(image, g.orientation)
        span[k, :, : g.y1 - g.y0, : g.x1 - g.x0] = picture[:, g.y0 : g.y1, g.x0 : g.x1]
    xi = _stacked([g.xi for g in geoms], torch.int64, device)
    xw = _stacked([g.xw for g in geoms], torch.int32, device)
    yi = _stacked([g.yi for g in geoms], torch.int64, device)
    yw = _stacked([g.yw for g in geoms], torch.int32, device)
    # Horizontal pass first (Pillow's order), rounded to 8 bits; then the vertical one. Each
    # pass reads whole rows: the axis it resizes first, everything else in a row.
    rows = _pass(span.permute(0, 3, 1, 2), xi, xw)  # (n, out_w, 3, h)
    out = _pass(rows.permute(0, 3, 2, 1), yi, yw)  # (n, out_h, 3, out_w)
    out = out.permute(0, 2, 1, 3).to(torch.uint8)
    flips = [k for k, g in enumerate(geoms) if g.flip]
    if flips:
        chosen = torch.tensor(flips, device=device)
        out[chosen] = out[chosen].flip(-1)
    return out
