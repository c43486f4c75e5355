"""What an encoded image is, read from its header alone (no pixel decoded), and which decoder
takes it.

The device decodes a batch of baseline JPEGs at once (:mod:`ftjob.data.device_decode`); a
batched decoder is not for everything a dataset holds. Each file's header says its format, its
size as stored, its EXIF orientation (the crop is drawn on the upright picture), its colour
components and whether it is progressive; anything that is not a baseline JPEG of 1 or 3
components that ends where a JPEG ends goes to the CPU decoder (PIL), by one of the
:data:`FALLBACKS` reasons, which summary.json counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftjob.metrics import FALLBACK_REASONS

# Why a file is decoded on the CPU rather than in the device's batch (summary.json counts
# each): not a JPEG (PNG, GIF, WebP...); a progressive JPEG; a 4-component (CMYK or YCCK)
# JPEG; any other JPEG the batched decoder is not for (not 8-bit, 2 components, an
# arithmetic-coded or lossless frame); one without an end-of-image marker where its bytes end
# (cut short: PIL says how, where a batched decoder may fill in grey or fail the batch); a
# file the device's decoder refused (a corrupt one: the batch found it by halving).
FALLBACKS = FALLBACK_REASONS
_EOI = b"\xff\xd9"
_END_SLACK = 32  # bytes after the end-of-image marker a writer may leave (padding)


@dataclass(frozen=True)
class ImageHeader:
    """An encoded image's header: its size as stored (before EXIF orientation), the
    orientation, and ``fallback`` -- None for the device's batch, else why the CPU decodes it."""

    width: int
    height: int
    orientation: int
    fallback: str | None

    @property
    def upright(self) -> tuple[int, int]:
        """(width, height) of the picture turned upright."""
        from ftjob.data.datasets import TURNED

        turned = self.orientation in TURNED
        return (self.height, self.width) if turned else (self.width, self.height)


def read_header(data: bytes, max_pixels: int | None) -> ImageHeader:
    """``data``'s header (PIL reads it without decoding a pixel). Raises what PIL raises for
    bytes it does not recognise, and :class:`~ftjob.data.datasets.ImageTooLarge` above
    ``max_pixels``: the caller sends such a file to the CPU decoder, which names it."""
    from ftjob.data.datasets import _open_image, _orientation

    with _open_image(data, max_pixels) as img:
        width, height = img.size
        return ImageHeader(width, height, _orientation(img), route(img, data))


def route(img: Any, data: bytes) -> str | None:
    """None where the device's batched decoder takes the opened image ``img``; else the
    :data:`FALLBACKS` reason it is decoded on the CPU."""
    if img.format != "JPEG":
        return "format"
    if img.info.get("progressive") or img.info.get("progression"):
        return "progressive"
    if img.mode == "CMYK" or getattr(img, "layers", 0) == 4:
        return "cmyk"
    if img.mode not in ("L", "RGB") or getattr(img, "bits", 8) != 8 or not _baseline(data):
        return "layout"
    if _EOI not in data[-(len(_EOI) + _END_SLACK) :]:
        return "truncated"
    return None


def _baseline(data: bytes) -> bool:
    """Whether the JPEG ``data``'s frame is sequential and Huffman-coded (SOF0 or SOF1): its
    segments walked from the start to the first frame marker."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return False
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return marker in (0xC0, 0xC1)
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return False
