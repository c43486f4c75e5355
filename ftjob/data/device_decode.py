"""Decoding on the training device (``trainer.decode_in=device``): the CPUs read encoded
bytes and headers, the device decodes and augments a batch at once.

Two stages. :meth:`DeviceDecoder.prepare` runs on the CPU, in the decode pool's threads, a
block of catalog rows at a time: the rows' encoded bytes (:meth:`ImageDataset.encoded`: image
files, Parquet row groups, ranged reads from an object store), each one's header
(:mod:`ftjob.data.headers`: size, EXIF orientation, whether the batched decoder takes it) and
its crop and flip, drawn from ``sample_rng(seed, epoch, id)`` in the order the PIL path draws
them; a file the batched decoder is not for (PNG, progressive, CMYK...) is decoded there and
then by the PIL path, counted by reason. :meth:`DeviceDecoder.batch` runs on the feeder thread,
a batch at a time, on a side CUDA stream: the bytes pinned, the batch decoded at once
(torchvision's ``decode_jpeg`` on a list: nvJPEG on a GPU, libjpeg-turbo on the CPU), turned
upright, cropped, resized and flipped by :mod:`ftjob.data.resample` (PIL's arithmetic), the
CPU-decoded rows copied in beside them. An event marks the batch ready; the training stream
waits on it (:meth:`ftjob.data.streams.Batch.settle`).

A batched decode fails the whole batch on one bad file: the batch is halved until the files
that fail alone are found, the rest decoded; each of those goes to the PIL path, and one that
fails there too is a bad file under ``dataset.bad_files`` (fail: the ``DataError`` naming it;
skip: skipped at its place) -- as on every other path.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ftjob import metrics as M
from ftjob.data.clock import DataClock
from ftjob.data.datasets import TRAIN, DataError, Encoded, sample_rng
from ftjob.data.headers import ImageHeader, read_header
from ftjob.data.resample import Geometry, resample, train_geometry, val_geometry

Blob = bytes | bytearray | memoryview  # an encoded file as its read gave it

# torchvision 0.29 deprecates its image decoders for TorchCodec's (benchmarks/gpu_decoders.py
# measures both); the batched decode_jpeg is still the one in the stack: said once, in the docs.
warnings.filterwarnings(
    "ignore",
    message="The image decoding and encoding capabilities of TorchVision",
    category=DeprecationWarning,
)


@dataclass
class Prepared:
    """A block of rows made ready on the CPU: what the device decodes (``data[k]`` and
    ``geoms[k]``, None for the others), what the CPU already decoded (``cpu``: row -> HWC
    uint8), which rows are skipped, and each row's name and sample seed."""

    ids: np.ndarray
    labels: np.ndarray
    skipped: np.ndarray
    data: list[Blob | None]
    geoms: list[Geometry | None]
    names: list[str]
    encoded: list[Any]  # as read, for a file the device refuses (decoded again by PIL)
    cpu: dict[int, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def size_bytes(self) -> int:
        held = sum(len(d) for d in self.data if d is not None)
        return held + sum(int(a.nbytes) for a in self.cpu.values())


class DeviceDecoder:
    """One split and epoch of an encoded dataset (:meth:`ImageDataset.encoded`), decoded on
    ``device`` (a CUDA device, or the CPU: the same code, libjpeg-turbo for nvJPEG)."""

    def __init__(
        self,
        dataset: Any,
        split: str,
        epoch: int,
        seed: int,
        device: Any,
        clock: DataClock,
        stream: Any = None,
        finish: Callable[[Any], Any] = lambda images: images,
    ) -> None:
        import torch

        self.dataset, self.split, self.epoch, self.seed = dataset, split, epoch, seed
        self.device, self.clock, self.stream = torch.device(device), clock, stream
        self.finish = finish  # uint8 images to what the model takes (normalised, its layout)
        self.train = split == TRAIN and bool(getattr(dataset, "augment", True))
        self.cuda = self.device.type == "cuda"

    # -- the CPU's part: bytes, headers, crops, fallbacks (the decode pool's threads) --------

    def prepare(self, rows: dict[str, np.ndarray]) -> Prepared:
        with self.clock.timer(M.DATA_READ):
            encoded: Encoded | None = self.dataset.encoded(rows, self.split, self.epoch)
        assert encoded is not None, "prepare() needs a dataset with encoded images"
        n = len(encoded.data)
        p = Prepared(
            ids=np.array(rows["id"], dtype=np.int64),  # copies: writable, the batch's own
            labels=np.array(rows["label"], dtype=np.int64),
            skipped=encoded.skipped.copy(),
            data=[None] * n,
            geoms=[None] * n,
            names=list(encoded.names),
            encoded=list(encoded.data),
        )
        fallbacks: Counter[str] = Counter()
        for k in range(n):
            if p.skipped[k]:
                continue
            data = encoded.data[k]
            if not isinstance(data, (bytes, bytearray, memoryview)):  # its read failed
                self._on_cpu(p, k)  # the PIL path names it (a bad file, or raised again)
                continue
            header = self._header(bytes(data))
            reason = "format" if header is None else header.fallback  # why the CPU decodes it
            if header is None or reason is not None:
                fallbacks[reason or "format"] += 1
                self._on_cpu(p, k)
                continue
            p.data[k] = data
            p.geoms[k] = self._geometry(header, int(p.ids[k]))
        for reason, count in fallbacks.items():
            self.clock.add(M.DATA_FALLBACK + reason, count)
        return p

    def _header(self, data: bytes) -> ImageHeader | None:
        """``data``'s header; None where PIL does not recognise the bytes or they hold too
        many pixels -- the PIL path then names the file."""
        with self.clock.timer(M.DATA_READ):
            try:
                return read_header(data, self.dataset.max_image_pixels)
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 -- the PIL path raises it with the file's name
                return None

    def _geometry(self, header: ImageHeader, sample_id: int) -> Geometry:
        """The sample's crop and flip, drawn as the PIL path draws them: the crop box on the
        upright picture, then the flip."""
        ds = self.dataset
        if self.train:
            rng = sample_rng(self.seed, self.epoch, sample_id)
            box = ds._crop_box(*header.upright, rng)
            flip = bool(rng.random() < 0.5)
            return train_geometry(header.upright, box, ds.image_size, header.orientation, flip)
        return val_geometry(header.upright, ds.image_size, ds.resize_size, header.orientation)

    def _on_cpu(self, p: Prepared, k: int) -> None:
        """Row ``k`` decoded by the PIL path; a bad file skipped (``bad_files=skip``) or
        raised as the dataset names it."""
        rng = sample_rng(self.seed, self.epoch, int(p.ids[k]))
        with self.clock.timer(M.DATA_DECODE):
            try:
                train = self.split == TRAIN
                p.cpu[k] = self.dataset.decode_encoded(p.encoded[k], p.names[k], train, rng)
            except DataError:
                if self.dataset.bad_files != "skip":
                    raise
                p.skipped[k] = True  # the same file fails the same way on every attempt

    # -- the device's part: a batch decoded and augmented (the feeder thread) ---------------

    def batch(self, p: Prepared, start: int, end: int) -> dict[str, Any]:
        """Rows ``start:end`` of ``p`` as a batch: ``image`` uint8 NCHW and ``label`` on the
        device, ``id`` and ``skipped`` on the CPU, ``ready`` an event the training stream
        waits on (None on the CPU)."""
        import torch

        if not self.cuda:
            return {**self._batch(p, start, end), "ready": None}
        with torch.cuda.stream(self.stream):
            out = self._batch(p, start, end)
            out["ready"] = torch.cuda.Event()
            out["ready"].record(self.stream)
        return out

    def _batch(self, p: Prepared, start: int, end: int) -> dict[str, Any]:
        import torch

        size = self.dataset.image_size
        rows = range(start, end)
        on_device = [k for k in rows if p.geoms[k] is not None and not p.skipped[k]]
        images = torch.zeros((end - start, 3, size, size), dtype=torch.uint8, device=self.device)
        decoded = self._decode_rows(p, on_device)
        kept = [k for k in on_device if decoded.get(k) is not None]
        with self._timed(M.DATA_AUGMENT):
            geoms = [
                g for k in kept if (g := p.geoms[k]) is not None
            ]  # each row on the device has one
            made = resample([decoded[k] for k in kept], geoms, self.device)
            if made is not None:
                images[self._at(kept, start)] = made
        cpu = [k for k in rows if k in p.cpu and not p.skipped[k]]
        with self._timed(M.DATA_COPY):
            if cpu:
                stacked = torch.from_numpy(np.stack([p.cpu[k] for k in cpu]).transpose(0, 3, 1, 2))
                images[self._at(cpu, start)] = self._to_device(stacked.contiguous())
            labels = self._to_device(torch.from_numpy(p.labels[start:end]))
        with self._timed(M.DATA_AUGMENT):
            images = self.finish(images)
        self.clock.add(M.DATA_DEVICE_DECODED, len(kept))
        return {
            "image": images,
            "label": labels,
            "id": torch.from_numpy(p.ids[start:end]),
            "skipped": torch.from_numpy(p.skipped[start:end].copy()),
        }

    def _at(self, rows: list[int], start: int) -> Any:
        import torch

        return torch.tensor([k - start for k in rows], device=self.device)

    def _to_device(self, tensor: Any) -> Any:
        if not self.cuda:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _decode_rows(self, p: Prepared, rows: list[int]) -> dict[int, Any]:
        """The rows' images decoded at once on the device; a row the decoder refused is
        decoded by the PIL path instead (into ``p.cpu``), or skipped as a bad file."""
        if not rows:
            return {}
        with self._timed(M.DATA_COPY):
            # a row with a geometry holds its bytes (set together in prepare): none is dropped
            blobs = self._pinned([blob for k in rows if (blob := p.data[k]) is not None])
        with self._timed(M.DATA_DECODE):
            images = self._decode_all(blobs)
        out = dict(zip(rows, images, strict=True))
        refused = [k for k, image in out.items() if image is None]
        if refused:
            self.clock.add(M.DATA_FALLBACK + "refused", len(refused))
            for k in refused:
                self._on_cpu(p, k)
        return out

    def _pinned(self, blobs: list[Blob]) -> list[Any]:
        """The encoded files as 1-D uint8 CPU tensors, in one page-locked buffer on a CUDA
        device (the decoder's copies to the device then run at the bus's speed, async)."""
        import torch

        sizes = [len(b) for b in blobs]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self.cuda)
        view = buffer.numpy()
        views, at = [], 0
        for blob, n in zip(blobs, sizes, strict=True):
            view[at : at + n] = np.frombuffer(blob, dtype=np.uint8)
            views.append(buffer[at : at + n])
            at += n
        return views

    def _decode_all(self, blobs: list[Any]) -> list[Any]:
        """Each blob decoded to a ``(3, H, W)`` uint8 tensor on the device, in one batched
        call; where it fails (one bad file fails it all), halved until the files that fail
        alone are found: None for each of those."""
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            with _no_fill():
                return list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=self.device))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if device_failed(exc):  # not the files': never a fallback that changes pixels
                raise
            if len(blobs) == 1:
                return [None]
            half = len(blobs) // 2
            return self._decode_all(blobs[:half]) + self._decode_all(blobs[half:])

    def _timed(self, key: str) -> Any:
        return StageTimer(self.clock, key, self.stream if self.cuda else None)


# torchvision re-raises every failure of the batched GPU decoder as one RuntimeError ("Error
# while decoding JPEG images: ..."): these say the device failed, not the files. Taken for a
# bad file, they would send whole batches to the CPU decoder, slower and with other pixels,
# as memory pressure happens to fall -- in exact mode a killed run would train on others.
DEVICE_FAILURES = (
    "out of memory",
    "ALLOCATOR_FAILURE",
    "EXECUTION_FAILED",
    "INTERNAL_ERROR",
    "ARCH_MISMATCH",
    "CUDA error",
    "Failed to synchronize",
)


def device_failed(exc: BaseException) -> bool:
    """Did the decoder's device fail (its memory, a kernel), rather than the batch's files?"""
    text = str(exc)
    return any(marker.lower() in text.lower() for marker in DEVICE_FAILURES)


_FILL = "fill_uninitialized_memory"  # a property of the module's object; torch's stubs omit it


class _no_fill:
    """Off for the batched decode: deterministic mode fills every new tensor
    (``torch.utils.deterministic.fill_uninitialized_memory``), which torchvision's GPU decoder
    queues on the caller's stream for its outputs while nvJPEG writes them on a stream of its
    own -- a fill that ran late would overwrite decoded pixels. The decoder writes every byte
    of its outputs: there is nothing uninitialised to fill."""

    def __enter__(self) -> None:
        import torch.utils.deterministic as deterministic

        self.was = getattr(deterministic, _FILL)
        setattr(deterministic, _FILL, False)

    def __exit__(self, *exc: Any) -> None:
        import torch.utils.deterministic as deterministic

        setattr(deterministic, _FILL, self.was)


class StageTimer:
    """A stage's seconds into the clock: wall time on the feeder thread, on a CUDA device up
    to the end of the stage's work on the side stream (the feeder waits for it; the training
    stream does not)."""

    def __init__(self, clock: DataClock, key: str, stream: Any) -> None:
        self.clock, self.key, self.stream = clock, key, stream

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.clock.add(self.key, time.perf_counter() - self.start)
