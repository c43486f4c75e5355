"""What a Ray Train user writes by hand for the digits job, shared by the benchmarks that set
it beside ftjob (startup.py, raytrain_recovery.py): embedded Ray with the training workers' CPUs
on top of the machine's (as ftjob starts it, for Ray Data's decode), and a Ray Data dataset of
the decoded training images."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

WORKERS = 2


@contextmanager
def embedded_ray() -> Iterator[None]:
    import ray

    ray.init(
        address="local",
        num_cpus=(os.cpu_count() or 1) + WORKERS,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def digits_train() -> tuple[int, Any]:
    """The training split's row count, and a Ray Data dataset of its decoded images."""
    import ray.data

    from ftjob.data.datasets import TRAIN, DigitsDataset
    from ftjob.data.streams import _Decode

    dataset = DigitsDataset()
    catalog = dataset.catalog(TRAIN)
    blocks = [catalog.slice(i, 128) for i in range(0, catalog.num_rows, 128)]
    decoded = ray.data.from_arrow(blocks).map_batches(
        _Decode(dataset, TRAIN, 0, 0), batch_size=None, batch_format="numpy"
    )
    return catalog.num_rows, decoded


# -- the seed benchmark's pipeline on a GPU: Ray Data decoding JPEGs on the CPUs ----------------


def jpeg_train(path: str, image_size: int, resize_size: int) -> tuple[int, Any, Any]:
    """An image folder's training split as a Ray Data dataset of decoded uint8 images (PIL,
    ftjob's crops: the same work per image as ftjob's worker path), its row count and the
    normalisation (mean, std)."""
    import ray.data

    from ftjob.data.datasets import TRAIN, ImageFolderDataset
    from ftjob.data.streams import _Decode

    dataset = ImageFolderDataset(path=path, image_size=image_size, resize_size=resize_size)
    catalog = dataset.catalog(TRAIN)
    blocks = [catalog.slice(i, 128) for i in range(0, catalog.num_rows, 128)]
    decoded = ray.data.from_arrow(blocks).map_batches(
        _Decode(dataset, TRAIN, 0, 0), batch_size=None, batch_format="numpy"
    )
    return catalog.num_rows, decoded, dataset.normalisation()


def gpu_loop(config: dict[str, Any]) -> None:
    """The hand-written Ray Train loop on one GPU: iter_torch_batches to the device, the
    images normalised there, bf16 autocast and channels_last as ftjob trains; images/s from
    the first step written to ``config["result_file"]``."""
    import json
    import time

    import ray.train
    import torch
    import torch.nn.functional as F

    from ftjob.worker.models import build_model

    device = ray.train.torch.get_device()
    torch.manual_seed(0)
    model = build_model(config["model"], config["classes"]).to(device)
    model = ray.train.torch.prepare_model(model.to(memory_format=torch.channels_last))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mean, std = (torch.tensor(v, device=device).reshape(1, 3, 1, 1) * 255 for v in config["norm"])
    shard = ray.train.get_dataset_shard("train")
    start, rows = None, 0
    for _ in range(config["epochs"]):
        for batch in shard.iter_torch_batches(
            batch_size=config["batch"], prefetch_batches=4, drop_last=True, device=device
        ):
            images = ((batch["image"].float() - mean) / std).contiguous(
                memory_format=torch.channels_last
            )
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(images), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if start is None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.time()
            else:
                rows += len(batch["label"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with open(config["result_file"], "w") as f:
        json.dump({"rows": rows, "seconds": time.time() - (start or time.time())}, f)
