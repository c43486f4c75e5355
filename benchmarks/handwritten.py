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
