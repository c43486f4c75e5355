"""Training throughput: ftjob vs a hand-written Ray Train loop vs plain PyTorch.

The same model (small_cnn), data, hyperparameters and work -- every method validates on the
validation split and saves a checkpoint (model + optimizer) at every epoch end, as ftjob does
by default -- through
  (a) plain torch: one process, batches decoded in the loop, global batch size;
  (b) a standard PyTorch DataLoader: one training process, a map-style dataset decoding one
      image per item in worker processes (one per core), what a user without Ray writes;
  (c) a hand-written Ray Train + Ray Data loop: TorchTrainer(datasets=...),
      get_dataset_shard(...).iter_torch_batches(), validation on the "val" shard and
      ray.train.report(checkpoint=...) from rank 0 at every epoch end, as Ray's docs show;
  (c') the same loop bare: no validation, no checkpoints (the comparison this benchmark
      made before: ftjob doing more work than the loop it was measured against);
  (d) ftjob: the full runner at its defaults, with the ledger, retrying storage and the
      resumable iterator; (d') the same decoding in Ray Data (trainer.decode_in=ray) where
      its default decodes in the training processes (CPU training holding every core).
Images/s three ways, each to the end of the last epoch's validation and checkpoint:
  - from the workers' start (every sample / seconds from the moment the training function
    starts on rank 0): like for like -- each method's data pipeline start-up, model set-up,
    every step, validation and checkpoint, after the same Ray cluster and worker group start;
  - from the first step (samples trained after it / seconds from it): the hand-written
    loop's Ray Data pipeline is up before its first batch, ftjob trains its first window
    while its decode pool starts, so this one counts ftjob's pipeline start-up and not the
    loop's;
  - over the whole job (every sample / seconds from the method's start: its cluster, trainer,
    driver-side preparation and data pipeline starting up).
For plain torch and the DataLoader (no cluster) the workers' start is the method's start. The
order of the methods rotates between repeats; the table shows medians and the ratios. The synthetic
validation set is ~4% of the training set, ImageNet's ratio; digits' fixed split validates 25%
as many images as it trains on each epoch. With imagefolder (JPEG files) it also prints the
decode rate of one core: what one core can feed, the bound of every method.

    python benchmarks/throughput.py [--repeats 5] [--datasets synthetic,digits,imagefolder]
        [--methods raytrain,ftjob]   # a subset: more repeats of the pair that matters
        [--datasets imagefolder,parquet]  # the same JPEGs as files and as Parquet shards:
                                          # prints parquet/folder and ftjob/raytrain parquet
        [--epochs N]                 # longer jobs: start-up weighs less

The last lines are ``ftjob/raytrain = X`` (like for like, from the workers' start),
``ftjob/raytrain first-step = X``, ``ftjob/raytrain job = X`` (the whole job), and the same
against the bare loop (of the first dataset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ftjob.data.datasets import TRAIN, VAL, build_dataset

WORKERS = 2


@dataclass(frozen=True)
class Rate:
    """Images/s three ways: ``workers``, every sample over the seconds from the training
    function's start on rank 0 to the end; ``window``, samples after the first step over
    the seconds from the first step to the end; ``job``, every sample over the seconds from
    the method's start (its cluster, trainer and data pipeline starting up included)."""

    workers: float
    window: float
    job: float


def _rate(
    rows_after_first: int,
    all_rows: int,
    began: float,
    first: float,
    end: float,
    workers: float | None = None,
) -> Rate:
    """From wall-clock times (time.time()): the method began, its training function started
    (``workers``; the method's start where there is no cluster), its first step ended, it
    ended."""
    return Rate(
        all_rows / (end - (began if workers is None else workers)),
        rows_after_first / (end - first),
        all_rows / (end - began),
    )


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: dict[str, Any]
    batch_size: int  # per worker
    epochs: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * WORKERS


WORKLOADS = {
    "synthetic": Workload(
        "synthetic 64px",
        {
            "_target_": "ftjob.datasets.SyntheticDataset",
            "num_samples": 8192,
            "num_val_samples": 320,  # ~4% of the training set, as ImageNet's 50k / 1.28M
            "image_size": 64,
        },
        batch_size=64,
        epochs=2,
    ),
    "digits": Workload(
        "digits", {"_target_": "ftjob.datasets.DigitsDataset"}, batch_size=32, epochs=6
    ),
    # Real JPEG files (written at start, 256 px, 8 classes), decoded, randomly cropped and
    # flipped to 64 px in the decode tasks, sent as uint8 and normalised in the workers.
    "imagefolder": Workload(
        "imagefolder JPEG",
        {
            "_target_": "ftjob.datasets.ImageFolderDataset",
            "path": None,  # set by write_jpeg_tree
            "image_size": 64,
            "resize_size": 73,
            "augment": True,
        },
        batch_size=64,
        epochs=2,
    ),
}
# The same JPEGs as Parquet shards (ftjob's writer: Ray's benchmark layout, shuffled rows,
# 256 rows a shard, 64 a row group), read by dataset=parquet; the hand-written loop reads them
# the way Ray's benchmark does (read_parquet + map(decode)).
WORKLOADS["parquet"] = Workload(
    "parquet JPEG",
    {**WORKLOADS["imagefolder"].dataset, "_target_": "ftjob.datasets.ParquetDataset"},
    batch_size=64,
    epochs=2,
)
JPEGS = {"train": 2048, "val": 96}  # per split, over 8 classes
MODEL = {"_target_": "ftjob.models.SmallCNN", "width": 32}
LR = 1e-3


def _model(num_classes: int) -> Any:
    import torch

    from ftjob.worker.models import build_model

    torch.manual_seed(0)
    return build_model(MODEL, num_classes)


def _train_step(model: Any, opt: Any, images: Any, labels: Any) -> None:
    import torch.nn.functional as F

    loss = F.cross_entropy(model(images), labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def write_jpeg_tree(root: str) -> None:
    """Class-per-folder JPEGs: smooth colour fields with noise, 256 x 256, quality 90."""
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:256, 0:256] / 256.0
    for split, count in JPEGS.items():
        for i in range(count):
            label = i % 8
            folder = os.path.join(root, split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            phase = rng.uniform(0, 2 * np.pi, 3)
            field = np.stack([np.sin(2 * np.pi * (label + 1) * xx + p) for p in phase], axis=-1)
            pixels = 127 + 100 * field + rng.normal(0, 12, field.shape)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
                os.path.join(folder, f"{i}.jpg"), quality=90
            )


def _as_float(images: Any, normalisation: Any) -> Any:
    """What the model takes: uint8 images (as decoded) normalised; float32 as they are."""
    import torch

    if images.dtype != torch.uint8:
        return images
    mean, std = (torch.tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in normalisation)
    return (images.float() / 255.0 - mean) / std


def _rows(table: pa.Table) -> dict[str, np.ndarray]:
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def _accuracy(model: Any, batches: Any, normalisation: Any) -> tuple[int, int]:
    """(correct, seen) over ``batches`` of (images, labels), in eval mode."""
    import torch

    model.eval()
    correct = seen = 0
    with torch.no_grad():
        for images, labels in batches:
            correct += int((model(_as_float(images, normalisation)).argmax(1) == labels).sum())
            seen += len(labels)
    model.train()
    return correct, seen


def _save(model: Any, opt: Any, directory: str) -> str:
    import torch

    os.makedirs(directory, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, os.path.join(directory, "checkpoint.pt"))
    return directory


def _catalog_batches(dataset: Any, split: str, batch: int, epoch: int) -> Any:
    """(images, labels) tensors of ``split`` in catalog order, decoded here."""
    import torch

    catalog = dataset.catalog(split)
    for start in range(0, catalog.num_rows, batch):
        rows = _rows(catalog.slice(start, batch))
        images = torch.from_numpy(dataset.decode(rows, split, epoch, 0))
        yield images, torch.from_numpy(rows["label"].astype(np.int64))


def decode_rate(w: Workload) -> float:
    """Images/s one core decodes (the training split, as the methods decode it)."""
    dataset = build_dataset(w.dataset)
    start, n = time.perf_counter(), 0
    for images, _ in _catalog_batches(dataset, TRAIN, w.batch_size, 0):
        n += len(images)
    return n / (time.perf_counter() - start)


# -- (a) plain torch ----------------------------------------------------------------------------


def plain_torch(w: Workload) -> Rate:
    import torch

    from ftjob.data.order import epoch_order

    began = time.time()
    torch.set_num_threads(os.cpu_count() or 1)
    dataset = build_dataset(w.dataset)
    catalog = dataset.catalog(TRAIN)
    model = _model(dataset.num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    B, n = w.global_batch, catalog.num_rows
    start, rows = None, 0
    for epoch in range(w.epochs):
        order = epoch_order(n, 0, epoch)
        for k in range(n // B):
            batch = _rows(catalog.take(pa.array(order[k * B : (k + 1) * B])))
            images = torch.from_numpy(dataset.decode(batch, TRAIN, epoch, 0))
            images = _as_float(images, dataset.normalisation())
            labels = torch.from_numpy(batch["label"].astype(np.int64))
            _train_step(model, opt, images, labels)
            if start is None:
                start = time.time()
            else:
                rows += B
        _accuracy(model, _catalog_batches(dataset, VAL, B, 0), dataset.normalisation())
        with tempfile.TemporaryDirectory() as checkpoint:
            _save(model, opt, checkpoint)
    return _rate(rows, rows + B, began, start, time.time())


# -- (b) a standard DataLoader ------------------------------------------------------------------


class _Items:
    """A map-style dataset: item i of a split, decoded (a torch Dataset by protocol)."""

    def __init__(self, dataset: Any, split: str) -> None:
        self.dataset, self.split, self.epoch = dataset, split, 0
        self.catalog = dataset.catalog(split)

    def __len__(self) -> int:
        return self.catalog.num_rows

    def __getitem__(self, i: int) -> tuple[Any, int]:
        rows = _rows(self.catalog.slice(i, 1))
        return self.dataset.decode(rows, self.split, self.epoch, 0)[0], int(rows["label"][0])


def dataloader(w: Workload) -> Rate:
    import torch
    from torch.utils.data import DataLoader

    began = time.time()
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    dataset = build_dataset(w.dataset)
    train, val = _Items(dataset, TRAIN), _Items(dataset, VAL)
    model = _model(dataset.num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    B = w.global_batch
    loader = DataLoader(train, B, shuffle=True, drop_last=True, num_workers=cores)
    val_loader = DataLoader(val, B, num_workers=cores)
    start, rows = None, 0
    for epoch in range(w.epochs):
        train.epoch = epoch  # the workers start with each epoch and copy it
        for images, labels in loader:
            _train_step(model, opt, _as_float(images, dataset.normalisation()), labels)
            if start is None:
                start = time.time()
            else:
                rows += B
        _accuracy(model, val_loader, dataset.normalisation())
        with tempfile.TemporaryDirectory() as checkpoint:
            _save(model, opt, checkpoint)
    return _rate(rows, rows + B, began, start, time.time())


# -- (c) hand-written Ray Train + Ray Data ------------------------------------------------------


class _ParquetRow:
    """Ray's benchmark's decode (``map`` over rows of ``read_parquet``): a row's JPEG bytes
    through the same transform as ftjob's, its label string to a class id."""

    def __init__(self, dataset: Any, split: str, index: dict[str, int]) -> None:
        self.dataset, self.train, self.index = dataset, split == TRAIN, index

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        rng = np.random.default_rng()
        image = self.dataset._transform(row["image"], self.train, rng)
        return {"image": image.transpose(2, 0, 1), "label": self.index[row["label"]]}


def _ray_datasets(dataset: Any) -> tuple[Any, Any]:
    """The hand-written loop's train and val datasets: Parquet shards read as Ray's benchmark
    reads them, or the catalog's blocks through ftjob's decode (any other dataset)."""
    import ray.data

    from ftjob.data.parquet import ParquetDataset
    from ftjob.data.streams import _Decode

    if isinstance(dataset, ParquetDataset):
        index = {name: i for i, name in enumerate(dataset.classes)}
        return tuple(  # type: ignore[return-value]
            ray.data.read_parquet(os.path.join(dataset.path, split)).map(
                _ParquetRow(dataset, split, index)
            )
            for split in (TRAIN, VAL)
        )
    catalog = dataset.catalog(TRAIN)
    blocks = [catalog.slice(i, 128) for i in range(0, catalog.num_rows, 128)]
    ds = ray.data.from_arrow(blocks).map_batches(
        _Decode(dataset, TRAIN, 0, 0), batch_size=None, batch_format="numpy"
    )
    val_ds = ray.data.from_arrow(dataset.catalog(VAL)).map_batches(
        _Decode(dataset, VAL, 0, 0), batch_size=None, batch_format="numpy"
    )
    return ds, val_ds


def _raytrain_loop(config: dict[str, Any]) -> None:
    fn_started = time.time()
    import ray.train
    import torch

    w: Workload = config["workload"]
    torch.set_num_threads(1)
    model = ray.train.torch.prepare_model(_model(config["num_classes"]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    shard, rank = ray.train.get_dataset_shard("train"), ray.train.get_context().get_world_rank()
    start, rows = None, 0
    for epoch in range(w.epochs):
        for batch in shard.iter_torch_batches(
            batch_size=w.batch_size, prefetch_batches=2, drop_last=True
        ):
            images = _as_float(batch["image"], config["normalisation"])
            _train_step(model, opt, images, batch["label"])
            if start is None:
                start = time.time()
            else:
                rows += w.global_batch
        if config["bare"]:
            continue
        val = ray.train.get_dataset_shard("val").iter_torch_batches(batch_size=w.batch_size)
        correct, seen = _accuracy(
            model, ((b["image"], b["label"]) for b in val), config["normalisation"]
        )
        counts = torch.tensor([correct, seen])
        torch.distributed.all_reduce(counts)
        metrics = {"epoch": epoch, "accuracy": float(counts[0] / counts[1])}
        with tempfile.TemporaryDirectory() as checkpoint:
            if rank == 0:
                _save(model.module, opt, checkpoint)
                saved = ray.train.Checkpoint.from_directory(checkpoint)
                ray.train.report(metrics, checkpoint=saved)
            else:
                ray.train.report(metrics)
    if rank == 0:  # Ray Train 2.60 keeps metrics only with checkpoints
        with open(config["result_file"], "w") as f:
            json.dump({"rows": rows, "fn": fn_started, "first": start, "end": time.time()}, f)


def raytrain(w: Workload, bare: bool = False) -> Rate:
    began = time.time()
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    dataset = build_dataset(w.dataset)
    ray.init(
        address="local",
        num_cpus=(os.cpu_count() or 1) + WORKERS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        ds, val_ds = _ray_datasets(dataset)
        with tempfile.TemporaryDirectory() as storage:
            result_file = os.path.join(storage, "images_per_s")
            TorchTrainer(
                _raytrain_loop,
                train_loop_config={
                    "workload": w,
                    "num_classes": dataset.num_classes,
                    "normalisation": dataset.normalisation(),
                    "result_file": result_file,
                    "bare": bare,
                },
                scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
                run_config=ray.train.RunConfig(storage_path=storage, name="raytrain"),
                datasets={"train": ds, "val": val_ds},
            ).fit()
            with open(result_file) as f:
                done = json.load(f)
            rows = done["rows"]
            done_at, first = done["end"], done["first"]
            return _rate(rows, rows + w.global_batch, began, first, done_at, done["fn"])
    finally:
        ray.shutdown()


# -- (d) ftjob ----------------------------------------------------------------------------------


def ftjob(w: Workload, decode_in: str = "auto") -> Rate:
    began = time.time()
    from ftjob.config import JobConfig, TrainerConfig
    from ftjob.driver import runner

    job = JobConfig(
        model=dict(MODEL),
        dataset=dict(w.dataset),
        trainer=TrainerConfig(
            num_workers=WORKERS,
            epochs=w.epochs,
            batch_size=w.batch_size,
            lr=LR,
            lr_schedule="constant",
            decode_in=decode_in,
        ),
    )
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
    if not result.ok:
        raise RuntimeError(f"ftjob run failed: {result.error}")
    summary = result.summary.document()  # the summary.json form
    timing, metrics = summary["timing"], summary["metrics"]
    rows = metrics["train/rows_processed"]
    first, end = timing["first_step"], timing["finished"]
    return _rate(rows - w.global_batch, rows, began, first, end, timing["workers_started"])


METHODS = {
    "plain torch": plain_torch,
    "dataloader": dataloader,
    "raytrain": raytrain,
    "raytrain bare": lambda w: raytrain(w, bare=True),
    "ftjob": ftjob,
    "ftjob ray-data": lambda w: ftjob(w, decode_in="ray"),  # as before trainer.decode_in=auto
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)  # runs of one method differ by ±5 %
    parser.add_argument("--datasets", default="synthetic,digits")
    parser.add_argument(
        "--epochs", type=int, default=0, help="every workload's epochs (0: each one's own)"
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="a subset, e.g. raytrain,ftjob (more repeats)"
    )
    args = parser.parse_args()
    methods = {m.strip(): METHODS[m.strip()] for m in args.methods.split(",") if m.strip()}
    logging.getLogger("ray").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    if args.epochs:
        for name in names:
            WORKLOADS[name] = dataclasses.replace(WORKLOADS[name], epochs=args.epochs)
    jpeg_dir = tempfile.TemporaryDirectory()
    if "imagefolder" in names or "parquet" in names:
        from ftjob.data.to_parquet import convert

        tree, shards = os.path.join(jpeg_dir.name, "tree"), os.path.join(jpeg_dir.name, "pq")
        write_jpeg_tree(tree)
        convert(tree, shards, 256, rows_per_group=64)
        WORKLOADS["imagefolder"].dataset["path"] = tree
        WORKLOADS["parquet"].dataset["path"] = shards
    results: dict[tuple[str, str], list[Rate]] = {}
    order = list(methods)
    for r in range(args.repeats):
        # Rotate the order each repeat: a method must not always run right after another's Ray
        # cluster shut down (its processes still exiting) or always first on a cold machine.
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name in names:
            for method in rotated:
                rate = methods[method](WORKLOADS[name])
                results.setdefault((name, method), []).append(rate)
                print(
                    f"[repeat {r + 1}/{args.repeats}] {name:<10} {method:<12} "
                    f"images/s {rate.workers:8.1f} from the workers' start, "
                    f"{rate.window:8.1f} from the first step, {rate.job:8.1f} over the whole job",
                    flush=True,
                )

    pairs = [
        (f"ftjob/{b.replace(' ', '-')}", b)
        for b in ("raytrain", "raytrain bare", "dataloader", "ftjob ray-data")
    ]
    pairs = [(label, b) for label, b in pairs if "ftjob" in methods and b in methods]
    columns = [*methods, *(label for label, _ in pairs)]
    headline: dict[str, dict[str, float]] = {}
    for kind, title in (
        ("workers", "from the workers' start (the training function) to the end"),
        ("window", "from each method's first step to its end"),
        ("job", "over the whole job: start-up, every step, validation, checkpoints"),
    ):
        print(
            f"\nimages/s {title}, median of {args.repeats} (small_cnn; {WORKERS} workers for "
            "Ray; one process with the global batch for plain torch and the DataLoader)"
        )
        print(f"{'dataset':<18}" + "".join(f"{c:>21}" for c in columns))
        for name in names:
            med = {
                m: statistics.median(getattr(x, kind) for x in results[(name, m)]) for m in methods
            }
            these = {label: med["ftjob"] / med[b] for label, b in pairs}
            headline.setdefault(kind, these)  # the first dataset's
            shown = [f"{med[m]:>21.1f}" for m in methods] + [f"{x:>21.3f}" for x in these.values()]
            print(f"{WORKLOADS[name].name:<18}" + "".join(shown))
    if "imagefolder" in names:
        rate = decode_rate(WORKLOADS["imagefolder"])
        print(
            f"decode, one core: {rate:.1f} images/s; {os.cpu_count()} cores: "
            f"{rate * (os.cpu_count() or 1):.1f} (the bound, before any training)"
        )
    for kind in ("workers", "window") if {"imagefolder", "parquet"} <= set(names) else ():
        for method in methods:
            ratio = statistics.median(
                getattr(x, kind) for x in results[("parquet", method)]
            ) / statistics.median(getattr(x, kind) for x in results[("imagefolder", method)])
            print(f"parquet/folder {method} ({kind}) = {ratio:.3f}")
    if "parquet" in names and {"ftjob", "raytrain"} <= set(methods):
        for kind in ("workers", "window", "job"):
            ratio = statistics.median(
                getattr(x, kind) for x in results[("parquet", "ftjob")]
            ) / statistics.median(getattr(x, kind) for x in results[("parquet", "raytrain")])
            print(f"ftjob/raytrain parquet ({kind}) = {ratio:.3f}")
    for label in ("ftjob/raytrain", "ftjob/raytrain-bare", "ftjob/ftjob-ray-data"):
        if label in headline.get("window", {}):
            print(
                f"{label} = {headline['workers'][label]:.3f} (like for like: from the workers' start)"
            )
            print(f"{label} first-step = {headline['window'][label]:.3f} (from the first step)")
            print(f"{label} job = {headline['job'][label]:.3f} (the whole job)")


if __name__ == "__main__":
    main()
