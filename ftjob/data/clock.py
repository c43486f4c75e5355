"""The input path's timers and counters, added from its threads (the decode pool, the feeder)
into the worker's metric set: one lock, so two threads never lose each other's seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ftjob.metrics import MetricSet


class DataClock:
    """Adds seconds and counts to ``metrics`` (rank 0's reach summary.json; without a metric
    set -- a stream no worker reads the metrics of -- they are kept here)."""

    def __init__(self, metrics: MetricSet | None = None) -> None:
        self.metrics = metrics if metrics is not None else MetricSet()
        self._lock = threading.Lock()

    def add(self, key: str, amount: float) -> None:
        with self._lock:
            self.metrics.add(key, amount)

    def get(self, key: str) -> float:
        with self._lock:
            return self.metrics.get(key)

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - start)
