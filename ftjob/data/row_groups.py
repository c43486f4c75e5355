"""The row groups a decoder holds: each read once per shuffle window.

With ``dataset.shuffle_window`` the epoch order is a random order of row groups cut into
windows of about that many samples, each window's samples shuffled together
(:class:`ftjob.data.order.ShuffleWindows`). A block of samples from a window needs most of the
window's groups, and the next block needs them again: a :class:`RowGroupCache` keeps the image
column of the groups read last, about a window's rows, so a process that decodes a window's
blocks reads each of its groups once. The caches are per process (Ray Data's decode workers
outlive their tasks and get a dataset afresh with each) and per split and epoch (the next
epoch's first window starts while this one ends; validation reads its own groups).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from ftjob.data.order import ShuffleWindows

CACHES_KEPT = 3  # (split, epoch) caches a process keeps: an epoch, the next, validation


class RowGroupCache:
    """Encoded images of the row groups read last: at least ``capacity`` rows' worth and the
    largest group read (a window holds fewer than ``capacity`` + one group's rows), dropped
    least recently used first. A group several threads want at once is read by one of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reads = 0  # groups read from storage
        self._largest = 0
        self._rows = 0
        self._held: collections.OrderedDict[
            Hashable, tuple[int, concurrent.futures.Future[list[Any]]]
        ] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, rows: int, read: Callable[[], list[Any]]) -> list[Any]:
        """The images of group ``key`` (``rows`` of them), read by ``read`` unless held."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                future, mine = held[1], False
            else:
                future, mine = concurrent.futures.Future(), True
                self._held[key] = (rows, future)
                self.reads += 1
                self._rows += rows
                self._largest = max(self._largest, rows)
                self._evict()
        if mine:
            try:
                future.set_result(read())
            except BaseException as exc:  # not handled: handed to the threads waiting on it,
                future.set_exception(exc)  # dropped from the cache, and raised here
                with self._lock:
                    if self._held.get(key, (0, None))[1] is future:
                        self._rows -= self._held.pop(key)[0]
                raise
        return future.result()

    def _evict(self) -> None:
        while self._rows > self.capacity + self._largest and len(self._held) > 1:
            _, (rows, _) = self._held.popitem(last=False)
            self._rows -= rows


_caches: collections.OrderedDict[Hashable, RowGroupCache] = collections.OrderedDict()
_caches_lock = threading.Lock()


def cache_for(key: Hashable, capacity: int) -> RowGroupCache:
    """This process's cache for ``key`` (a dataset's split and epoch), made on first use;
    the oldest of more than :data:`CACHES_KEPT` is dropped."""
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = RowGroupCache(capacity)
            while len(_caches) > CACHES_KEPT:
                _caches.popitem(last=False)
        else:
            _caches.move_to_end(key)
        return cache


def group_images(
    wanted: Iterable[tuple[str, int]],
    read: Callable[[str, int], list[Any]],
    held_as: Callable[[tuple[str, int]], tuple[Hashable, int]],
    cache_key: Hashable,
    window: int,
) -> dict[tuple[str, int], list[Any]]:
    """The images of the row groups ``(shard, group)`` a block wants, read in the order given
    (the block's first need of each); with a shuffle ``window``, through this process's cache
    for ``cache_key`` (``held_as``: a group's key in it, and its rows)."""
    if not window:
        return {key: read(*key) for key in wanted}
    cache = cache_for(cache_key, window)
    out = {}
    for key in wanted:
        held, rows = held_as(key)
        out[key] = cache.get(held, rows, functools.partial(read, *key))
    return out


def catalog_windows(catalog: pa.Table, window: int) -> ShuffleWindows | None:
    """A Parquet catalog's row groups (runs of rows of one shard and group, in id order)
    shuffled in windows of ``window`` samples; None at 0 (every sample anywhere)."""
    if not window or catalog.num_rows == 0:
        return None
    shard = catalog.column("shard").combine_chunks().indices.to_numpy()
    group = np.asarray(catalog.column("group"))
    change = np.flatnonzero((np.diff(shard) != 0) | (np.diff(group) != 0)) + 1
    bounds = np.concatenate([[0], change, [catalog.num_rows]])
    return ShuffleWindows.of_groups(np.diff(bounds), window)
