"""The resumable data iterator: each rank streams its slice of the epoch order
(:mod:`ftjob.data.order`) from the saved position, decoded ahead of training.

Global batch ``k`` is ``order[k*B:(k+1)*B]``; rank ``r`` of ``W`` trains the ``r``-th slice of
``B/W`` samples of it. Reading and decoding run in Ray Data (``map_batches``, in order), in
windows of blocks that decode while the previous window trains; each worker streams its own
slice, so batch ``k`` on every rank belongs to global batch ``k``.

A sample whose file does not decode under ``dataset.bad_files=skip`` keeps its place: its
batch carries it, marked ``skipped``, and the step trains on the rest. Positions, batches and
the audit stay those of the data order; only what a step learns from changes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from ftjob import metrics as M
from ftjob.data.bad_files import over_budget
from ftjob.data.clock import DataClock
from ftjob.data.datasets import (
    GONE,
    TRAIN,
    VAL,
    DataError,
    ImageDataset,
    ImageFolderDataset,
    decode_rows,
)
from ftjob.data.device_decode import DeviceDecoder, StageTimer
from ftjob.data.order import EpochPlan, epoch_order, validation_ids
from ftjob.ray_internals import STREAMING_EXECUTOR_LOGGER
from ftjob.record import SkippedFile

logger = logging.getLogger(__name__)


@dataclass
class Batch:
    images: Any  # torch.Tensor, NCHW float32 on the training device
    labels: Any  # torch.Tensor, int64
    ids: np.ndarray  # catalog ids, for the sample audit
    skipped: np.ndarray | None = None  # bool per row: a bad file (dataset.bad_files=skip)
    ready: Any = None  # a CUDA event: the side stream that made the batch finished it

    def settle(self) -> Batch:
        """The batch made safe on the calling thread's current CUDA stream, where a side
        stream made it (``decode_in=device``): that stream waits for the batch's event (on
        the device: the host does not), and the caching allocator keeps its memory until
        this stream is done with it too. Called by the thread that trains or validates."""
        if self.ready is not None:
            import torch

            current = torch.cuda.current_stream(self.images.device)
            current.wait_event(self.ready)
            self.images.record_stream(current)
            self.labels.record_stream(current)
        return self

    def any_skipped(self) -> bool:
        return self.skipped is not None and bool(self.skipped.any())

    def skipped_ids(self) -> list[int]:
        return self.ids[self.skipped].tolist() if self.any_skipped() else []

    def keep(self) -> Any:
        """The rows to train or evaluate on, as a bool tensor on the images' device; None
        when every row is kept."""
        if not self.any_skipped():
            return None
        import torch

        assert self.skipped is not None
        return torch.from_numpy(~self.skipped).to(self.images.device)


class BatchSource(Protocol):
    """What the training loop iterates: one epoch's batches from a position on."""

    def epoch(self, epoch: int, position: int) -> Iterator[Batch]: ...


class _Decode:
    """Ray Data map_batches callable: catalog rows -> image/label/id columns. In the training
    process (``clock``), reading and decoding are timed apart where the dataset reads
    encoded files."""

    def __init__(
        self, dataset: ImageDataset, split: str, epoch: int, seed: int, clock: Any = None
    ) -> None:
        self.dataset, self.split, self.epoch, self.seed = dataset, split, epoch, seed
        self.clock = clock

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images, skipped = self._decoded(rows)
        return {
            "image": images,
            "label": rows["label"].astype(np.int64),
            "id": rows["id"].astype(np.int64),
            "skipped": np.asarray(skipped, dtype=bool),
        }

    def _decoded(self, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ds, split, epoch, seed = self.dataset, self.split, self.epoch, self.seed
        if self.clock is None:
            return ds.decode_batch(rows, split, epoch, seed)
        if type(ds).decode_batch is not ImageFolderDataset.decode_batch:  # its own decode
            with self.clock.timer(M.DATA_DECODE):
                return ds.decode_batch(rows, split, epoch, seed)
        assert isinstance(ds, ImageFolderDataset)
        with self.clock.timer(M.DATA_READ):
            encoded = ds.encoded(rows, split, epoch)
        with self.clock.timer(M.DATA_DECODE):
            return decode_rows(ds, encoded, rows["id"], split, epoch, seed)


def configure_ray_data() -> None:
    """Per-process Ray Data settings the iterator relies on (order) and the console wants."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    # One "execution finished" line per decoded window would drown the worker logs.
    logging.getLogger(STREAMING_EXECUTOR_LOGGER).setLevel(logging.WARNING)


def decode_in_worker(
    setting: str,
    use_gpu: bool,
    cores: float,
    local_workers: int,
    worker_cpus: float,
    decode_cpus: float = 1.0,
    one_machine: bool = True,
) -> tuple[bool, str]:
    """Where a rank decodes its batches, training and validation (``trainer.decode_in``): in
    its own process (True) or in Ray Data tasks (False), and why. ``auto`` decodes in the
    process only where Ray Data could gain nothing: the whole cluster is this one machine
    (``one_machine``) and its CPU training workers (``local_workers x worker_cpus``) hold its
    cores (``cores``: what this process may use, cgroup limits included), leaving less than
    one decode task's ``decode_cpus``. Ray Data's tasks would then share the training's cores
    and add their processes, start-up and object-store copies (measured on 2 cores, 2
    workers, JPEGs: from the first step to the end 10-11.5 s in the process against
    15.4-16 s in Ray Data). GPU training, a core to spare, or other machines in the cluster
    (Ray Data spreads its tasks over them): Ray Data."""
    if setting != "auto":
        return setting == "worker", f"trainer.decode_in={setting}"
    if use_gpu:
        return gpu_decode_place(cores, local_workers, worker_cpus, one_machine)
    if not one_machine:
        return False, "the cluster has other machines for Ray Data's decode tasks"
    spare = cores - local_workers * worker_cpus
    if spare < decode_cpus:
        return True, (
            f"{cores:g} cores for {local_workers} CPU training workers of {worker_cpus:g} CPU "
            f"on this one-machine cluster: none to spare for a decode task of {decode_cpus:g}"
        )
    return False, f"{spare:g} of {cores:g} cores on this machine to spare beside the training"


def decode_threads(use_gpu: bool, worker_cpus: float) -> int:
    """Decode threads in a training process that decodes its own batches: a GPU worker's
    reserved CPUs but the one its training loop runs on (``resources_per_worker.CPU - 1``); a
    CPU worker's one, beside the step that trains on its cores."""
    return max(1, int(worker_cpus) - 1) if use_gpu else 1


def gpu_decode_place(
    cores: float, local_workers: int, worker_cpus: float, one_machine: bool
) -> tuple[bool, str]:
    """``decode_in=auto`` for GPU workers: a pool of the worker's reserved CPUs but one
    (:func:`decode_threads`) where it has any, unless this one-machine cluster leaves Ray
    Data more cores per worker beside the workers' reservations."""
    threads = decode_threads(True, worker_cpus)
    if int(worker_cpus) < 2:
        return False, (
            f"GPU training, {worker_cpus:g} CPU reserved a worker (resources_per_worker.CPU): "
            "Ray Data decodes on the cluster's CPUs"
        )
    spare = (cores - local_workers * worker_cpus) / max(1, local_workers)
    if one_machine and spare > threads:
        return False, (
            f"GPU training: {spare:g} unreserved cores a worker on this machine for Ray Data, "
            f"more than the {threads} a worker's own pool would have"
        )
    return True, (
        f"GPU training: each worker decodes with {threads} thread(s), the "
        f"{worker_cpus:g} CPUs it reserves but the one its training loop runs on"
    )


class DecodedStream:
    """Streams catalog rows through ``dataset.decode``, in the given order, in windows of
    blocks decoded ahead of training; where a window is decoded is the subclass's
    :meth:`_decode`: :class:`RayDataStream` or :class:`InProcessStream`."""

    def __init__(
        self,
        dataset: ImageDataset,
        catalog: pa.Table,
        split: str,
        *,
        seed: int,
        device: Any = "cpu",
        prefetch_batches: int = 2,
        pin_memory: bool = False,
        channels_last: bool = False,
        window_mb: float = 256,
        on_skip: Callable[[str, np.ndarray], None] | None = None,
        clock: DataClock | None = None,
    ) -> None:
        self.dataset, self.catalog, self.split = dataset, catalog, split
        self.clock = clock  # the input's timers (rank 0's reach summary.json); None: untimed
        self.on_skip = on_skip  # hears (split, ids) of every batch with skipped samples
        self.seed, self.device = seed, device
        self.prefetch_batches = prefetch_batches
        self.pin_memory, self.channels_last = pin_memory, channels_last
        self.window_bytes = int(window_mb * 2**20)
        self._scale: tuple[Any, Any] | None = None  # uint8 -> normalised float, on the device

    def _normalised(self, images: Any) -> Any:
        """uint8 images (as decoded, sent through the object store) normalised to float32 on
        the training device; float32 images as they are."""
        import torch

        if images.dtype != torch.uint8:
            return images
        if self._scale is None:
            mean, std = self.dataset.normalisation() or ((0.0,) * 3, (1.0,) * 3)
            shape = (1, len(mean), 1, 1)
            m = torch.tensor(mean, dtype=torch.float32, device=images.device).reshape(shape)
            s = torch.tensor(std, dtype=torch.float32, device=images.device).reshape(shape)
            self._scale = (m * 255.0, s * 255.0)
        m, s = self._scale
        return (images.float() - m) / s

    def batches(self, ids: np.ndarray, batch_size: int, epoch: int) -> Iterator[Batch]:
        import torch

        if len(ids) == 0:
            return
        rows = self.catalog.take(pa.array(ids))
        # Blocks of whole batches: batch boundaries never straddle blocks, and several
        # blocks decode in parallel ahead of the training step.
        block = batch_size * max(1, 128 // batch_size)
        blocks = [rows.slice(i, block) for i in range(0, rows.num_rows, block)]
        decode = self._decoder(epoch)
        # As decoded: uint8 when the dataset normalises on the device, else float32.
        image_dtype = torch.uint8 if self.dataset.normalisation() else torch.float32
        for window in self._windows(blocks, decode):
            for b in window.iter_torch_batches(
                batch_size=batch_size,
                prefetch_batches=self.prefetch_batches,
                device=self.device,
                pin_memory=self.pin_memory,
                dtypes={
                    "image": image_dtype,
                    "label": torch.int64,
                    "id": torch.int64,
                    "skipped": torch.bool,
                },
            ):
                # A batch made on the device is the model's input already, and its side
                # stream's: nothing more is done to it before the training stream waits.
                made = "ready" in b
                batch = Batch(
                    images=b["image"] if made else self._model_input(b["image"]),
                    labels=b["label"],
                    ids=b["id"].cpu().numpy(),
                    skipped=b["skipped"].cpu().numpy(),
                    ready=b.get("ready"),
                )
                if self.on_skip is not None and batch.any_skipped():
                    self.on_skip(self.split, np.asarray(batch.skipped_ids(), dtype=np.int64))
                yield batch

    def _model_input(self, images: Any) -> Any:
        """Decoded images as the model takes them: normalised, in its memory layout."""
        import torch

        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        return self._normalised(images).contiguous(memory_format=layout)

    def _decoder(self, epoch: int) -> Any:
        """What decodes one epoch's blocks (handed to :meth:`_decode`)."""
        return _Decode(self.dataset, self.split, epoch, self.seed, self.clock)

    def _decode(self, blocks: list[pa.Table], decode: Any) -> Any:
        """One window's blocks decoded, in order: something with ``size_bytes()`` and
        ``iter_torch_batches(...)``, as a materialized Ray dataset has."""
        raise NotImplementedError

    def _windows(self, blocks: list[pa.Table], decode: Any) -> Iterator[Any]:
        """Decoded windows of blocks; the next window decodes while the current one trains.

        Why windows and not one streaming dataset: a Ray Data streaming executor whose
        consumer (the training step) is slower than its tasks polls in a tight loop, in the
        training process, for as long as the stream lasts; a window's executor runs only
        while it decodes, then the window is read like any materialized dataset."""
        sizer = WindowSizer(self.window_bytes, len(blocks))
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ftjob-decode")
        pending: collections.deque[tuple[concurrent.futures.Future[Any], int]] = collections.deque()

        def submit() -> None:
            window = sizer.next_window()
            if window is not None:
                start, end = window
                pending.append((pool.submit(self._decode, blocks[start:end], decode), end - start))

        try:
            submit()
            submit()
            while pending:
                future, num_blocks = pending.popleft()
                window = future.result()
                sizer.observe(window.size_bytes(), num_blocks)
                submit()
                yield window
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # no decode outlives its stream


class RayDataStream(DecodedStream):
    """Windows decoded by Ray Data tasks; with ``local_first_window``, the first window of the
    stream's first epoch is decoded in this process (:class:`LocalWindow`) while the next
    starts in Ray Data."""

    def __init__(
        self,
        *args: Any,
        decode_cpus: float = 1.0,
        local_first_window: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.decode_cpus, self._local_first = decode_cpus, local_first_window

    def batches(self, ids: np.ndarray, batch_size: int, epoch: int) -> Iterator[Batch]:
        if len(ids):
            configure_ray_data()
        yield from super().batches(ids, batch_size, epoch)

    def _decoder(self, epoch: int) -> Any:
        return _Decode(self.dataset, self.split, epoch, self.seed)  # timed in its own tasks

    def _decode(self, blocks: list[pa.Table], decode: _Decode) -> Any:
        """One window's blocks decoded by Ray Data tasks, in order, held in the object store."""
        import ray.data

        if self._local_first:
            self._local_first = False
            return LocalWindow.decode(blocks, decode)

        ds = ray.data.from_arrow(blocks).map_batches(
            decode, batch_size=None, batch_format="numpy", num_cpus=self.decode_cpus
        )
        return ds.materialize()


class InProcessStream(DecodedStream):
    """Every window decoded in the training process (:class:`LocalWindow`), no Ray Data task:
    ``trainer.decode_in=worker``, ``auto`` where Ray Data could gain nothing
    (:func:`decode_in_worker`), and a worker run without Ray (tests). A window's blocks are
    decoded by ``threads`` threads (:func:`decode_threads`; image decoding and resizing run
    outside the GIL), in order."""

    def __init__(self, *args: Any, threads: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads = threads

    def _decode(self, blocks: list[pa.Table], decode: _Decode) -> Any:
        return self._each(blocks, lambda each: LocalWindow.decode(blocks, decode, each))

    def _each(self, blocks: list[pa.Table], work: Callable[[Callable[..., Any]], Any]) -> Any:
        """``work(each)`` where ``each`` maps over ``blocks``: ``map``, or the pool's."""
        if self.threads < 2 or len(blocks) < 2:
            return work(map)
        with concurrent.futures.ThreadPoolExecutor(
            min(self.threads, len(blocks)), thread_name_prefix="ftjob-decode-pool"
        ) as pool:
            return work(pool.map)


class DeviceStream(InProcessStream):
    """``trainer.decode_in=device``: the pool's threads read each block's encoded bytes and
    headers and draw its crops (:meth:`DeviceDecoder.prepare`); each batch is decoded and
    augmented on the training device when the feeder asks for it, on a side CUDA stream, while
    the step before it trains (:meth:`DeviceDecoder.batch`). A dataset without encoded images
    that makes its own on the device (``dataset=synthetic``) makes them there; any other is
    decoded by the pool (:class:`InProcessStream`)."""

    clock: DataClock

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        super().__init__(*args, **kwargs)
        self.clock = self.clock or DataClock()
        # The side stream batches are made on (a CUDA device; None on the CPU), made here:
        # the feeder and the next epoch's starting thread both make batches on it.
        device = torch.device(self.device)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        # One batch at a time on it: the next epoch's first batch is made on a helper thread
        # while the feeder makes this epoch's last. Two threads' work interleaved on one
        # stream lets the caching allocator give one a block the other's queued kernels still
        # use (nvJPEG writes on a stream of its own, ordered against neither).
        self._side_lock = threading.Lock()

    def _stream(self) -> Any:
        return self._side

    def _decoder(self, epoch: int) -> Any:
        if not encodes(self.dataset):
            return super()._decoder(epoch)
        return DeviceDecoder(
            self.dataset,
            self.split,
            epoch,
            self.seed,
            self.device,
            self.clock,
            self._stream(),
            self._model_input,
        )

    def _decode(self, blocks: list[pa.Table], decode: Any) -> Any:
        if isinstance(decode, DeviceDecoder):
            rows = [numpy_rows(block) for block in blocks]
            prepared = self._each(rows, lambda each: list(each(decode.prepare, rows)))
            return DeviceWindow(prepared, self._one_at_a_time(decode.batch))
        if makes_on_device(self.dataset):
            rows = [numpy_rows(block) for block in blocks]
            return DeviceWindow(rows, self._one_at_a_time(self._synthetic(decode.epoch)))
        return super()._decode(blocks, decode)

    def _one_at_a_time(
        self, make: Callable[[Any, int, int], Any]
    ) -> Callable[[Any, int, int], Any]:
        """``make`` holding the side stream: its work there is finished when it returns (its
        stages wait for it), so the next thread's batch never overlaps it."""

        def made(part: Any, start: int, end: int) -> Any:
            with self._side_lock:
                return make(part, start, end)

        return made

    def _synthetic(self, epoch: int) -> Callable[[dict[str, np.ndarray], int, int], dict[str, Any]]:
        """Batches made on the device by the dataset itself (on the side stream)."""
        import torch

        def make(rows: dict[str, np.ndarray], start: int, end: int) -> dict[str, Any]:
            part = {k: v[start:end] for k, v in rows.items()}
            stream = self._stream()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                with StageTimer(self.clock, M.DATA_DECODE, stream):
                    images = self.dataset.on_device(part, self.split, epoch, self.seed, self.device)
                    images = self._model_input(images)
                    labels = torch.from_numpy(part["label"].astype(np.int64)).to(self.device)
                ready = None
                if stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(stream)
            return {
                "image": images,
                "label": labels,
                "id": torch.from_numpy(part["id"].astype(np.int64)),
                "skipped": torch.zeros(end - start, dtype=torch.bool),
                "ready": ready,
            }

        return make


def encodes(dataset: ImageDataset) -> bool:
    """Whether ``dataset`` hands over encoded images (:meth:`ImageDataset.encoded`)."""
    return type(dataset).encoded is not ImageDataset.encoded


def makes_on_device(dataset: ImageDataset) -> bool:
    """Whether ``dataset`` makes its images on the device itself (:meth:`ImageDataset.on_device`)."""
    return type(dataset).on_device is not ImageDataset.on_device


def numpy_rows(block: pa.Table) -> dict[str, np.ndarray]:
    """Catalog rows as a decoder takes them (Ray Data's numpy batch format)."""
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(block).to_batch_format("numpy")


class DeviceWindow:
    """A window of blocks made ready on the CPU, read like a materialized dataset: each batch
    made on the device (``make(part, start, end)``) when it is asked for."""

    def __init__(self, parts: list[Any], make: Callable[[Any, int, int], dict[str, Any]]) -> None:
        self.parts, self.make = parts, make

    def size_bytes(self) -> int:
        return sum(_held(p) for p in self.parts)

    def iter_torch_batches(self, *, batch_size: int, **_: Any) -> Iterator[dict[str, Any]]:
        for part in self.parts:
            rows = len(part) if not isinstance(part, dict) else len(part["id"])
            for start in range(0, rows, batch_size):
                yield self.make(part, start, min(rows, start + batch_size))


def _held(part: Any) -> int:
    if isinstance(part, dict):
        return sum(int(v.nbytes) for v in part.values() if hasattr(v, "nbytes"))
    return int(part.size_bytes())


class LocalWindow:
    """A window decoded in the training process, read like a materialized Ray dataset.

    A (re)started worker's first batch would otherwise wait for Ray Data to start decode
    worker processes -- on a replacement node, seconds of interpreter and import start-up on
    cores the new training workers need too. The first window is one block (a few batches):
    the same rows, the same decode and the same batches as Ray Data would give, decoded here
    while the next window starts in Ray Data."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns

    @classmethod
    def decode(
        cls, blocks: list[pa.Table], decode: _Decode, each: Callable[..., Any] = map
    ) -> LocalWindow:
        """``blocks`` decoded, in order; ``each``: ``map``, or a thread pool's."""
        from ray.data.block import BlockAccessor

        def one(block: pa.Table) -> dict[str, np.ndarray]:
            return decode(BlockAccessor.for_block(block).to_batch_format("numpy"))

        parts = list(each(one, blocks))
        return cls({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})

    def size_bytes(self) -> int:
        return sum(int(v.nbytes) for v in self.columns.values())

    def iter_torch_batches(
        self,
        *,
        batch_size: int,
        dtypes: dict[str, Any],
        device: Any = "cpu",
        pin_memory: bool = False,
        prefetch_batches: int = 0,
    ) -> Iterator[dict[str, Any]]:
        import torch

        rows = len(next(iter(self.columns.values())))
        for start in range(0, rows, batch_size):
            batch = {}
            for key, values in self.columns.items():
                t = torch.as_tensor(values[start : start + batch_size], dtype=dtypes.get(key))
                if pin_memory:
                    t = t.pin_memory()
                batch[key] = t.to(device, non_blocking=pin_memory)
            yield batch


class WindowSizer:
    """Windows of blocks for :meth:`DecodedStream._windows`: the first is one block (the
    first batch comes as soon as one block decodes), then each doubles while two windows of
    decoded data stay within ``budget_bytes``."""

    def __init__(self, budget_bytes: int, num_blocks: int) -> None:
        self.budget, self.num_blocks = budget_bytes, num_blocks
        self.start, self.size, self.block_bytes = 0, 1, 0.0

    def observe(self, window_bytes: int, num_blocks: int) -> None:
        self.block_bytes = max(self.block_bytes, window_bytes / max(1, num_blocks))

    def next_window(self) -> tuple[int, int] | None:
        if self.start >= self.num_blocks:
            return None
        cap = int(self.budget // (2 * self.block_bytes)) if self.block_bytes else 2
        size = max(1, min(self.size, cap))
        window = (self.start, min(self.num_blocks, self.start + size))
        self.start, self.size = window[1], size * 2
        return window


class SkipLog:
    """Names the files behind skipped samples (``dataset.bad_files=skip``), each once per
    process: the dataset reads it again for the reason (a skip is rare; decode tasks do not
    carry reasons back), and ``tell`` hears their records and answers how many bad samples
    each split has had in the run (every rank's, each once). A split past
    ``dataset.max_bad_fraction`` of its catalog (:mod:`ftjob.data.bad_files`) is the run's
    :class:`DataError`, raised where the batch is consumed -- and again at every skip after
    it, so a stream read again (validation after its prefetch failed) meets it too."""

    def __init__(
        self,
        dataset: ImageDataset,
        catalogs: dict[str, pa.Table],
        tell: Callable[[list[SkippedFile]], dict[str, int]],
    ) -> None:
        self.dataset, self.catalogs, self.tell = dataset, catalogs, tell
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._over: str | None = None  # the budget's verdict, once exceeded

    def __call__(self, split: str, ids: np.ndarray) -> None:
        with self._lock:
            new = [int(i) for i in ids if (split, int(i)) not in self._seen]
            self._seen.update((split, i) for i in new)
        if new:
            rows = self.catalogs[split].take(pa.array(new, type=pa.int64())).to_pylist()
            records = []
            for sample_id, row in zip(new, rows, strict=True):
                bad = self.dataset.bad_file(row)
                records.append(SkippedFile(split, sample_id, bad.path, bad.reason))
            counts = self.tell(records)
            self._over = self._over or self._budget(split, counts.get(split, 0), records[0])
        if self._over:
            raise DataError(self._over)

    def _budget(self, split: str, bad: int, example: SkippedFile) -> str | None:
        """The budget's verdict on ``split`` with ``bad`` samples skipped in the run. Rows
        removed since the run started (skipped unread) are not bad files: the count less all
        of them is what is known to be bad."""
        catalog = self.catalogs[split]
        gone = catalog.column(GONE).to_numpy() if GONE in catalog.column_names else []
        removed = int(np.count_nonzero(gone))
        fraction = self.dataset.max_bad_fraction
        seen = f"{example.path}: {example.reason}"
        return over_budget(split, bad - removed, catalog.num_rows, fraction, seen)


class ResumableIterator:
    """Exact-once, constant-cost resumable training batches for one rank."""

    def __init__(self, stream: DecodedStream, plan: EpochPlan, rank: int, world_size: int) -> None:
        self.stream, self.plan, self.rank, self.world_size = stream, plan, rank, world_size
        self.batch_size = plan.global_batch_size // world_size

    def epoch(self, epoch: int, position: int) -> Iterator[Batch]:
        ids = self.plan.shard(epoch, position, self.rank, self.world_size)
        return self.stream.batches(ids, self.batch_size, epoch)


EPOCH_END = object()  # BatchFeeder's marker after an epoch's last batch
_DONE = object()


class _Primed:
    """An epoch's stream started on a helper thread, up to and including its first batch."""

    def __init__(self, iterator: BatchSource, epoch: int) -> None:
        self._result: tuple[Iterator[Batch], Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(iterator, epoch), name="ftjob-prime", daemon=True
        )
        self._thread.start()

    def _run(self, iterator: BatchSource, epoch: int) -> None:
        try:
            batches = iter(iterator.epoch(epoch, 0))
            self._result = (batches, next(batches, _DONE))
        except BaseException as exc:  # raised where the epoch is consumed
            self._error = exc

    def take(self) -> Iterator[Batch]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        batches, first = self._result
        if first is not _DONE:
            yield first
        yield from batches


class BatchFeeder:
    """Pulls training batches on a background thread, across epoch boundaries, into a small
    queue. ``lookahead`` batches before an epoch ends, the next epoch's stream starts on a
    helper thread (the stream start-up and its first decode run while the current epoch
    finishes, validates and checkpoints), so epoch boundaries do not stall training.
    Yields ``(epoch, Batch)`` and ``(epoch, EPOCH_END)``; re-raises errors."""

    def __init__(
        self,
        iterator: BatchSource,
        first: Iterator[Batch],
        first_epoch: int,
        epochs: int,
        depth: int,
        *,
        first_steps: int,
        steps_per_epoch: int,
        lookahead: int = 8,
    ) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(iterator, first, first_epoch, epochs, first_steps, steps_per_epoch, lookahead),
            name="ftjob-feeder",
            daemon=True,
        )
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(
        self,
        iterator: BatchSource,
        first: Iterator[Batch],
        first_epoch: int,
        epochs: int,
        first_steps: int,
        steps_per_epoch: int,
        lookahead: int,
    ) -> None:
        try:
            batches, steps, primed = first, first_steps, None
            for epoch in range(first_epoch, epochs):
                last = epoch + 1 == epochs
                for k, batch in enumerate(batches):
                    if not last and primed is None and steps - k <= lookahead:
                        primed = _Primed(iterator, epoch + 1)
                    if not self._put((epoch, batch)):
                        return
                if not self._put((epoch, EPOCH_END)):
                    return
                if not last:
                    batches = (primed or _Primed(iterator, epoch + 1)).take()
                    steps, primed = steps_per_epoch, None
            self._put(None)
        except BaseException as exc:  # handed to the training thread
            self._put(exc)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            epoch, batch = item
            if isinstance(batch, Batch):
                batch.settle()  # on the training thread: its stream waits for the batch
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a pending put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=30)


class _Stream(Protocol):
    def batches(self, ids: np.ndarray, batch_size: int, epoch: int) -> Iterator[Batch]: ...


def _nbytes(batch: Batch) -> int:
    return int(batch.images.element_size() * batch.images.nelement())


class ValidationSet:
    """One rank's validation batches. They are the same at every validation (no augmentation),
    so when they fit in ``cache_bytes`` they are decoded once and kept. ``prefetch()`` fills
    the cache on a background thread while training runs, so even the first validation does
    not wait for the stream to start and decode; iterating starts the prefetch if needed and
    waits for it."""

    def __init__(
        self,
        stream: _Stream,
        ids: np.ndarray,
        batch_size: int,
        cache_bytes: int,
        note: Callable[[str], None] | None = None,
    ) -> None:
        self.stream, self.ids, self.batch_size = stream, ids, batch_size
        self.cache_bytes = cache_bytes
        self.note = note or (lambda line: logger.warning(line))
        self.cache: list[Batch] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _fill(self) -> None:
        kept: list[Batch] = []
        size = 0
        try:
            for batch in self.stream.batches(self.ids, self.batch_size, epoch=0):
                size += _nbytes(batch)
                need = _nbytes(batch) / len(batch.ids) * len(self.ids)
                if not kept and need > self.cache_bytes:  # known from the first batch
                    self.note(
                        f"the validation set of a worker needs {need / 2**20:.0f} MB decoded, more "
                        f"than trainer.validation_cache_mb={self.cache_bytes / 2**20:.0f}: every "
                        "validation decodes it again; raise it to decode once"
                    )
                    return
                if size > self.cache_bytes or self._stop.is_set():
                    return  # closing (or a last batch larger than the rest)
                kept.append(batch)
        except Exception:
            return  # the validation itself streams and raises it where it is seen
        self.cache = kept

    def prefetch(self) -> None:
        if self.cache_bytes > 0 and self.cache is None and self._thread is None:
            self._thread = threading.Thread(
                target=self._fill, name="ftjob-val-prefetch", daemon=True
            )
            self._thread.start()

    def __iter__(self) -> Iterator[Batch]:
        self.prefetch()  # no-op once cached, or once known not to fit
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.cache is None:  # did not fit or failed: never prefetch again
                self.cache_bytes = 0
        batches = (
            self.cache
            if self.cache is not None
            else self.stream.batches(self.ids, self.batch_size, epoch=0)
        )
        for batch in batches:
            yield batch.settle()  # on the validating thread's stream

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


__all__ = [
    "EPOCH_END",
    "TRAIN",
    "VAL",
    "Batch",
    "BatchFeeder",
    "BatchSource",
    "EpochPlan",
    "LocalWindow",
    "DecodedStream",
    "DeviceStream",
    "InProcessStream",
    "RayDataStream",
    "ResumableIterator",
    "SkipLog",
    "ValidationSet",
    "WindowSizer",
    "decode_threads",
    "epoch_order",
    "validation_ids",
]
