"""Where a run decodes its batches (``trainer.decode_in``), and ``auto``'s probe.

Three places: ``worker`` (the training process's decode pool, PIL), ``ray`` (Ray Data tasks,
PIL) and ``device`` (:mod:`ftjob.data.device_decode`: the CPUs read bytes, the training device
decodes and augments). ``auto`` takes the one place there is where there is one (CPU training
on a one-machine cluster whose workers hold its cores: the worker; a dataset with nothing to
decode on a device...), else measures the others on the first batch of rank 0's slice --
images/s of each, :func:`probe` -- and takes the fastest. The choice is kept with the run
(the run ledger, and every checkpoint's metrics), so every rank and every attempt decode the
same way: the places' pixels differ slightly (nvJPEG is not libjpeg-turbo), and a restart must
not switch them under a model half trained.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ftjob.data.clock import DataClock
from ftjob.data.datasets import TRAIN, ImageDataset
from ftjob.data.device_decode import DeviceDecoder
from ftjob.data.streams import _Decode, decode_in_worker, encodes, makes_on_device

# A Ray Data decode task's images/s a core, against a thread of the worker's own pool on the
# same machine (benchmarks/RESULTS.md, "A GPU worker's JPEG decoding", one H200's 16 cores:
# ~55 a core against ~160 a thread -- its tasks' start, the object store's copies): what
# auto's estimate of Ray Data's rate weighs each of its cores with.
RAY_DATA_SHARE = 0.34
PROBE_ROWS = 128  # at most this many samples of rank 0's first batch are probed


def on_device(dataset: ImageDataset) -> bool:
    """Whether ``dataset``'s batches can be made on a device: encoded images, or its own."""
    return encodes(dataset) or makes_on_device(dataset)


def auto_places(
    use_gpu: bool,
    cuda: bool,
    dataset: ImageDataset,
    cores: float,
    local_workers: int,
    worker_cpus: float,
    decode_cpus: float,
    one_machine: bool,
) -> tuple[list[str], str]:
    """The places ``auto`` chooses between for this rank, and why (for a single place:
    why it is the only one). CPU training keeps the rule measured on CPUs
    (:func:`~ftjob.data.streams.decode_in_worker`): the training shares its cores with any
    decoding, so there is one place. A GPU worker has its device (where the dataset's images
    can be made there), its pool, and Ray Data where the cluster has cores beyond the
    workers' reservations."""
    if not use_gpu:
        here, why = decode_in_worker(
            "auto", False, cores, local_workers, worker_cpus, decode_cpus, one_machine
        )
        return ["worker" if here else "ray"], why
    places = ["device"] if cuda and on_device(dataset) else []
    places.append("worker")
    if ray_cores(cores, local_workers, worker_cpus, one_machine) > 0:
        places.append("ray")
    if len(places) == 1:
        return places, "GPU training with no cores beside the workers' and no device decode"
    return places, "auto's probe"


def ray_cores(cores: float, local_workers: int, worker_cpus: float, one_machine: bool) -> float:
    """Ray Data's cores for each of this machine's workers: those its workers do not reserve
    (on a cluster of several machines, at least one: Ray Data spreads over the others)."""
    spare = max(cores - local_workers * worker_cpus, 0.0) / max(1, local_workers)
    return spare if one_machine else max(spare, 1.0)


def probe(
    dataset: ImageDataset,
    rows: dict[str, np.ndarray],
    places: list[str],
    *,
    seed: int,
    device: Any,
    threads: int,
    ray_share_cores: float,
    epoch: int = 0,
) -> dict[str, float]:
    """Images/s of each place on ``rows`` (the first batch of rank 0's slice): the worker's
    pool of ``threads`` threads decoding them with PIL; the device -- its CPU part (bytes,
    headers, crops) on the same pool and its decode and augment, whichever is slower, as the
    two overlap in a run; Ray Data estimated from the pool's rate a thread times its cores
    (``ray_share_cores``) and :data:`RAY_DATA_SHARE` (no task is started to measure it: a
    probe there would time its processes' start)."""
    n = len(rows["id"])
    parts = [{k: v[i::threads] for k, v in rows.items()} for i in range(max(1, min(threads, n)))]
    rates: dict[str, float] = {}
    decode = _Decode(dataset, TRAIN, epoch, seed)
    pool_s = _timed(lambda: _each(threads, decode, parts))
    if "worker" in places or "ray" in places:
        rates["worker"] = n / pool_s
    if "ray" in places:
        rates["ray"] = n / pool_s / max(1, threads) * ray_share_cores * RAY_DATA_SHARE
    if "device" in places:
        rates["device"] = _device_rate(dataset, rows, parts, threads, seed, device, epoch)
    return {place: round(rate, 1) for place, rate in rates.items() if place in places}


def _device_rate(
    dataset: ImageDataset,
    rows: dict[str, np.ndarray],
    parts: list[dict[str, np.ndarray]],
    threads: int,
    seed: int,
    device: Any,
    epoch: int,
) -> float:
    import torch

    n = len(rows["id"])
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    if not encodes(dataset):  # images made on the device by the dataset itself
        dataset.on_device(_head(rows, 2), TRAIN, epoch, seed, device)  # warm-up
        sync()
        return n / _timed(lambda: (dataset.on_device(rows, TRAIN, epoch, seed, device), sync()))
    decoder = DeviceDecoder(dataset, TRAIN, epoch, seed, device, DataClock())
    warm = decoder.prepare(_head(rows, 2))  # the device decoder's start (nvJPEG's handle)
    decoder.batch(warm, 0, len(warm))
    sync()
    prepared: list[Any] = []
    cpu_s = _timed(lambda: prepared.extend(_each(threads, decoder.prepare, parts)))
    device_s = _timed(lambda: ([decoder.batch(p, 0, len(p)) for p in prepared], sync()))
    return n / max(cpu_s, device_s)


def _head(rows: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    return {k: v[:n] for k, v in rows.items()}


def _each(threads: int, work: Callable[[Any], Any], parts: list[Any]) -> list[Any]:
    if threads < 2 or len(parts) < 2:
        return [work(p) for p in parts]
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ftjob-probe") as pool:
        return list(pool.map(work, parts))


def _timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return max(time.perf_counter() - start, 1e-9)


def fastest(rates: dict[str, float], places: list[str]) -> str:
    """The place with the highest rate (ties: the earlier of ``places``)."""
    return max(places, key=lambda p: (rates.get(p, 0.0), -places.index(p)))


def probe_line(place: str, rates: dict[str, float]) -> str:
    """``decode on the device: device 5400 images/s, worker 900, ray ~310 (estimated)``."""
    shown = []
    for name, rate in sorted(rates.items(), key=lambda kv: -kv[1]):
        shown.append(f"{name} {'~' if name == 'ray' else ''}{rate:.0f}")
    estimated = " (ray: estimated)" if "ray" in rates else ""
    return f"auto's probe, images/s: {', '.join(shown)}{estimated}"
