"""JPEG decoders side by side on ImageNet-like files (400x350, ~110 KB, quality 90): images/s
of decoding alone and of decoding with ftjob's crop, resize and flip, on one machine.

  pil               ftjob's worker path (PIL, draft mode), one thread and a pool of every core
  torchvision-cpu   torchvision's decode_jpeg on the CPU (libjpeg-turbo), one thread: alone, and
                    with PIL's crop-resize and flip (the PIL path's bytes exactly)
  ftjob-device      ftjob's device path (DeviceDecoder: headers and crops on the CPU, a batch
                    decoded by torchvision's decode_jpeg on a list -- nvJPEG -- and resized
                    by data/resample.py on the GPU); also its decode alone, and whether the
                    same bytes give the same pixels twice
  torchcodec        TorchCodec's JPEG decoder on the GPU (torchvision's successor), decode only
  dali              NVIDIA DALI: fn.decoders.image(device="mixed") and its random resized crop,
                    a pipeline of the same files, decode + crop

A decoder that is not installed (or fails to start) is skipped with its reason. TorchCodec's
wheel is ~10 MB and can travel in the GPU check's site (benchmarks/gpu_site.sh with
GPU_SITE_TORCHCODEC=1); DALI's (nvidia-dali-cuda130) is ~190 MB, more than the 64 MB a GPU
machine without network can be sent with the working tree: there it is skipped, saying so.

    python benchmarks/gpu_decoders.py [--files 512] [--batch 128] [--repeats 3]
    python benchmarks/gpu_decoders.py --device cpu --files 16 --batch 8 --repeats 1   # dry run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ftjob.data.clock import DataClock  # noqa: E402
from ftjob.data.datasets import TRAIN, ImageFolderDataset, sample_rng  # noqa: E402
from ftjob.data.device_decode import DeviceDecoder  # noqa: E402
from ftjob.data.streams import numpy_rows  # noqa: E402
from tests.support.images import jpeg, photo_like  # noqa: E402

SIZE = 224


def write_files(root: str, n: int) -> list[bytes]:
    """``n`` ImageNet-like JPEGs under ``root/train/a`` (and one validation file)."""
    os.makedirs(os.path.join(root, TRAIN, "a"), exist_ok=True)
    os.makedirs(os.path.join(root, "val", "a"), exist_ok=True)
    with concurrent.futures.ProcessPoolExecutor() as pool:
        files = list(pool.map(_one, range(n), chunksize=16))
    for i, data in enumerate(files):
        with open(os.path.join(root, TRAIN, "a", f"{i:05d}.jpg"), "wb") as f:
            f.write(data)
    with open(os.path.join(root, "val", "a", "v.jpg"), "wb") as f:
        f.write(files[0])
    return files


def _one(seed: int) -> bytes:
    return jpeg(photo_like(seed))


def rate(work: Callable[[], Any], n: int, repeats: int, sync: Callable[[], None]) -> float:
    """Median images/s of ``work`` (``n`` images) over ``repeats`` runs after a warm-up."""
    work()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return n / statistics.median(times)


def pil_path(ds: ImageFolderDataset, files: list[bytes], threads: int) -> Callable[[], Any]:
    def one(k: int) -> Any:
        return ds.decode_encoded(files[k], f"{k}", True, sample_rng(0, 0, k))

    def work() -> Any:
        if threads == 1:
            return [one(k) for k in range(len(files))]
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, range(len(files))))

    return work


def candidates(args: argparse.Namespace, root: str, files: list[bytes]) -> dict[str, Any]:
    """Each decoder's work, or the reason it is skipped."""
    from torchvision.io import ImageReadMode, decode_jpeg

    ds = ImageFolderDataset(path=root, image_size=SIZE, resize_size=256)
    cores = os.cpu_count() or 1
    tensors = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    out: dict[str, Any] = {
        "pil, 1 thread": pil_path(ds, files, 1),
        f"pil, {cores} threads": pil_path(ds, files, cores),
        "torchvision-cpu decode, 1 thread": lambda: [
            decode_jpeg(t, mode=ImageReadMode.RGB) for t in tensors
        ],
        "torchvision-cpu decode + PIL crop-resize, flip, 1 thread": lambda: [
            _turbo_then_pil(ds, t, k) for k, t in enumerate(tensors)
        ],
    }
    device = torch.device(args.device)
    rows = numpy_rows(ds.catalog(TRAIN))
    decoder = DeviceDecoder(ds, TRAIN, 0, 0, device, DataClock(), _stream(device))
    prepared = [
        decoder.prepare({k: v[i : i + args.batch] for k, v in rows.items()})
        for i in range(0, len(files), args.batch)
    ]
    out[f"ftjob-device on {device.type}: decode + crop, resize, flip (CPU part done)"] = lambda: [
        decoder.batch(p, 0, len(p)) for p in prepared
    ]
    out[f"torchvision decode_jpeg on {device.type}, batches of {args.batch}"] = lambda: [
        decode_jpeg(tensors[i : i + args.batch], mode=ImageReadMode.RGB, device=device)
        for i in range(0, len(tensors), args.batch)
    ]
    out["torchcodec decode on cuda"] = _torchcodec(tensors, device)
    out["dali mixed decode + random resized crop"] = _dali(files, args.batch, device)
    return out


def _turbo_then_pil(ds: ImageFolderDataset, data: torch.Tensor, k: int) -> np.ndarray:
    """libjpeg-turbo through torchvision, then PIL's own crop-resize and flip."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    rng = sample_rng(0, 0, k)
    pixels = decode_jpeg(data, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()
    box = ds._crop_box(pixels.shape[1], pixels.shape[0], rng)
    out = Image.fromarray(pixels).resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def gil(files: list[bytes]) -> str:
    """How much of its pace a Python loop keeps beside a thread decoding with each CPU
    decoder: near 100 % where the decoder releases the GIL, as a decode pool needs."""
    import io
    import threading

    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    def loop_rate() -> int:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.5:
            count += 1
        return count

    said = []
    for name, decode in (
        ("PIL", lambda f: Image.open(io.BytesIO(f)).convert("RGB")),
        (
            "torchvision",
            lambda f: decode_jpeg(
                torch.frombuffer(bytearray(f), dtype=torch.uint8), mode=ImageReadMode.RGB
            ),
        ),
    ):
        alone, stop = loop_rate(), threading.Event()

        def work(decode: Any = decode, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                for f in files[:4]:
                    decode(f)

        thread = threading.Thread(target=work)
        thread.start()
        beside = loop_rate()
        stop.set()
        thread.join()
        said.append(f"{name} {beside / alone:.0%}")
    return "a Python loop's pace beside a decoding thread: " + ", ".join(said)


def _stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _torchcodec(tensors: list[torch.Tensor], device: torch.device) -> Any:
    if device.type != "cuda":
        return "skipped: no CUDA device"
    try:
        import torchcodec.decoders as decoders
    except Exception as exc:  # noqa: BLE001 -- any failure to import is a reason to skip
        return (
            f"skipped: torchcodec not importable ({type(exc).__name__}: {str(exc)[:150]}); "
            "benchmarks/gpu_site.sh carries its wheel with GPU_SITE_TORCHCODEC=1"
        )
    decode = getattr(decoders, "decode_jpeg", None)
    if decode is None:
        return f"skipped: torchcodec {getattr(decoders, '__name__', '')} has no decode_jpeg"
    return lambda: [decode(t, device=device) for t in tensors]


def _dali(files: list[bytes], batch: int, device: torch.device) -> Any:
    if device.type != "cuda":
        return "skipped: no CUDA device"
    try:
        from nvidia.dali import fn, pipeline_def, types
    except Exception as exc:  # noqa: BLE001
        return (
            f"skipped: nvidia-dali not importable ({type(exc).__name__}); its wheel "
            "(nvidia-dali-cuda130, ~190 MiB) is more than the 64 MiB a machine without network "
            "is sent with the working tree"
        )
    arrays = [np.frombuffer(f, dtype=np.uint8) for f in files]

    @pipeline_def(batch_size=batch, num_threads=min(8, os.cpu_count() or 1), device_id=0)
    def pipe() -> Any:
        data = fn.external_source(
            source=lambda info: arrays[info.idx_in_epoch % len(arrays)], batch=False
        )
        images = fn.decoders.image_random_crop(data, device="mixed", output_type=types.RGB)
        return fn.resize(images, resize_x=SIZE, resize_y=SIZE)

    p = pipe()
    p.build()
    steps = max(1, len(files) // batch)
    return lambda: [p.run() for _ in range(steps)]


def deterministic(args: argparse.Namespace, root: str) -> str:
    ds = ImageFolderDataset(path=root, image_size=SIZE, resize_size=256)
    rows = numpy_rows(ds.catalog(TRAIN))
    rows = {k: v[: args.batch] for k, v in rows.items()}
    device = torch.device(args.device)
    made = []
    for _ in range(2):
        decoder = DeviceDecoder(ds, TRAIN, 0, 0, device, DataClock(), _stream(device))
        p = decoder.prepare(rows)
        made.append(decoder.batch(p, 0, len(p))["image"].cpu())
    same = torch.equal(made[0], made[1])
    pil = np.stack(
        [
            ds.decode_encoded(open(path, "rb").read(), path, True, sample_rng(0, 0, int(i)))
            for path, i in zip(rows["path"], rows["id"], strict=True)
        ]
    )
    diff = np.abs(made[0].permute(0, 2, 3, 1).numpy().astype(int) - pil.astype(int))
    return (
        f"ftjob-device on {device.type}: the same bytes twice -> {'the same' if same else 'other'} "
        f"pixels ({'PASS' if same else 'FAIL'}: deterministic); against the PIL path mean "
        f"{diff.mean():.3f}, max {diff.max()} levels"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--root", default=None, help="where to write the files (default: a temp dir)"
    )
    args = parser.parse_args()
    import tempfile

    root = args.root or tempfile.mkdtemp(prefix="ftjob-decoders-")
    files = write_files(root, args.files)
    kb = sum(len(f) for f in files) / len(files) / 1024
    print(f"{len(files)} JPEGs 400x350 quality 90, {kb:.0f} KB on average; output {SIZE} px")
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, work in candidates(args, root, files).items():
        if isinstance(work, str):
            print(f"{name:<78} {work}")
            continue
        try:
            value = rate(work, len(files), args.repeats, sync)
        except Exception as exc:  # noqa: BLE001 -- one decoder's failure skips it, not the rest
            print(f"{name:<78} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"{name:<78} {value:9.1f} images/s", flush=True)
    print(deterministic(args, root))
    print(gil(files))


if __name__ == "__main__":
    main()
