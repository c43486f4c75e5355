"""Training throughput: ftjob vs a hand-written Ray Train loop vs plain torch.

The same model (small_cnn), data and hyperparameters through
  (a) plain torch: one process, batches decoded in the loop, global batch size;
  (b) a minimal hand-written Ray Train + Ray Data loop: TorchTrainer(datasets=...),
      get_dataset_shard(...).iter_torch_batches(), no checkpoints, no validation;
  (c) ftjob: the full runner, checkpointing and validating at its default frequencies
      (every epoch end), with the ledger, retrying storage and the resumable iterator.
Images/s = samples trained after the first step / seconds from the first step to the end of
training (start-up costs, the same for (b) and (c), are excluded). The order of the methods
rotates between repeats. The synthetic validation set
is ~4% of the training set, ImageNet's ratio; digits' fixed split validates 25% as many images
as it trains on each epoch, so validation weighs more there. Methods run interleaved,
repeated; the table shows medians and the ratios.

    python benchmarks/throughput.py [--repeats 5] [--datasets synthetic,digits,imagefolder]

The last line is ``ftjob/raytrain = X`` (synthetic data).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ftjob.data.datasets import TRAIN, build_dataset

WORKERS = 2


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


# -- (a) plain torch ----------------------------------------------------------------------------


def plain_torch(w: Workload) -> float:
    import torch

    from ftjob.data.order import epoch_order

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
                start = time.perf_counter()
            else:
                rows += B
    return rows / (time.perf_counter() - start)


# -- (b) hand-written Ray Train + Ray Data ------------------------------------------------------


def _raytrain_loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch

    w: Workload = config["workload"]
    torch.set_num_threads(1)
    model = ray.train.torch.prepare_model(_model(config["num_classes"]))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    shard = ray.train.get_dataset_shard("train")
    start, rows = None, 0
    for _ in range(w.epochs):
        for batch in shard.iter_torch_batches(
            batch_size=w.batch_size, prefetch_batches=2, drop_last=True
        ):
            images = _as_float(batch["image"], config["normalisation"])
            _train_step(model, opt, images, batch["label"])
            if start is None:
                start = time.perf_counter()
            else:
                rows += w.global_batch
    if (
        ray.train.get_context().get_world_rank() == 0
    ):  # Ray Train 2.60 keeps metrics only with checkpoints
        with open(config["result_file"], "w") as f:
            f.write(str(rows / (time.perf_counter() - start)))


def raytrain(w: Workload) -> float:
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from ftjob.data.streams import _Decode

    dataset = build_dataset(w.dataset)
    catalog = dataset.catalog(TRAIN)
    ray.init(
        address="local",
        num_cpus=(os.cpu_count() or 1) + WORKERS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        blocks = [catalog.slice(i, 128) for i in range(0, catalog.num_rows, 128)]
        ds = ray.data.from_arrow(blocks).map_batches(
            _Decode(dataset, TRAIN, 0, 0), batch_size=None, batch_format="numpy"
        )
        with tempfile.TemporaryDirectory() as storage:
            result_file = os.path.join(storage, "images_per_s")
            TorchTrainer(
                _raytrain_loop,
                train_loop_config={
                    "workload": w,
                    "num_classes": dataset.num_classes,
                    "normalisation": dataset.normalisation(),
                    "result_file": result_file,
                },
                scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
                run_config=ray.train.RunConfig(storage_path=storage, name="raytrain"),
                datasets={"train": ds},
            ).fit()
            with open(result_file) as f:
                return float(f.read())
    finally:
        ray.shutdown()


# -- (c) ftjob ----------------------------------------------------------------------------------


def ftjob(w: Workload) -> float:
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
        ),
    )
    with tempfile.TemporaryDirectory() as run_dir:
        result = runner.run(job, run_dir, echo=lambda line: None)
    if not result.ok:
        raise RuntimeError(f"ftjob run failed: {result.error}")
    timing, metrics = result.summary["timing"], result.summary["metrics"]
    rows = metrics["train/rows_processed"] - w.global_batch
    return rows / (timing["finished"] - timing["first_step"])


METHODS = {"plain torch": plain_torch, "raytrain": raytrain, "ftjob": ftjob}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)  # runs of one method differ by ±5 %
    parser.add_argument("--datasets", default="synthetic,digits")
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    jpeg_dir = tempfile.TemporaryDirectory()
    if "imagefolder" in names:
        write_jpeg_tree(jpeg_dir.name)
        WORKLOADS["imagefolder"].dataset["path"] = jpeg_dir.name
    results: dict[tuple[str, str], list[float]] = {}
    order = list(METHODS)
    for r in range(args.repeats):
        # Rotate the order each repeat: a method must not always run right after another's Ray
        # cluster shut down (its processes still exiting) or always first on a cold machine.
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name in names:
            for method in rotated:
                fn = METHODS[method]
                value = fn(WORKLOADS[name])
                results.setdefault((name, method), []).append(value)
                print(
                    f"[repeat {r + 1}/{args.repeats}] {name:<10} {method:<12} {value:8.1f} images/s",
                    flush=True,
                )

    print(
        f"\nimages/s, median of {args.repeats} (small_cnn, {WORKERS} workers for Ray; global batch for plain torch)"
    )
    print(
        f"{'dataset':<16} {'plain torch':>12} {'raytrain':>10} {'ftjob':>10} {'ftjob/raytrain':>15} {'ftjob/plain':>12}"
    )
    ratio = None
    for name in names:
        med = {m: statistics.median(results[(name, m)]) for m in METHODS}
        ratio_name = med["ftjob"] / med["raytrain"]
        ratio = ratio_name if ratio is None else ratio
        print(
            f"{WORKLOADS[name].name:<16} {med['plain torch']:>12.1f} {med['raytrain']:>10.1f} {med['ftjob']:>10.1f} "
            f"{ratio_name:>15.3f} {med['ftjob'] / med['plain torch']:>12.3f}"
        )
    print(f"ftjob/raytrain = {ratio:.3f}")


if __name__ == "__main__":
    main()
