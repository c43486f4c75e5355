"""``dataset.shuffle_window``: the epoch order of row-grouped data (the row groups in a random
order, the samples shuffled within windows of consecutive groups) is a permutation, a function
of seed and epoch, resumable anywhere at any world size; a decode reads each row group once per
window (reads counted through real Parquet files on disk); and GPU workers decode with the CPUs
they reserve."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from ftjob.config import ConfigError
from ftjob.data import row_groups
from ftjob.data.datasets import TRAIN, epoch_plan
from ftjob.data.order import EpochPlan, ShuffleWindows, epoch_order
from ftjob.data.parquet import GROUP, SHARD, ParquetDataset
from ftjob.data.row_groups import RowGroupCache
from ftjob.data.streams import decode_in_worker, decode_threads
from ftjob.data.to_parquet import convert
from tests.support.images import make_image_tree
from tests.unit.data.test_data import _trained
from tests.unit.data.test_parquet import CountingFS, image_chunks, overlaps

GROUPS = np.array([8] * 31 + [5] + [8] * 9 + [3])  # 40 groups of 8, a 5 and a 3: 328


def test_the_windowed_order_is_a_permutation_of_whole_groups_fixed_by_seed_and_epoch():
    windows = ShuffleWindows.of_groups(GROUPS, window=20)
    assert (windows.sizes, windows.counts) == ((8, 5, 8, 3), (31, 1, 9, 1))
    order = epoch_order(328, seed=3, epoch=1, windows=windows)
    assert sorted(order.tolist()) == list(range(328))
    assert np.array_equal(order, epoch_order(328, 3, 1, windows))
    assert not np.array_equal(order, epoch_order(328, 3, 2, windows))
    assert not np.array_equal(order, epoch_order(328, 4, 1, windows))
    # Each window is a run of the order holding whole groups: >= 20 samples (the last: the rest).
    group_of = np.repeat(np.arange(len(GROUPS)), GROUPS)
    window_of = windows.window_index(3, 1)[order]
    assert np.all(np.diff(window_of) >= 0)  # windows follow one another
    sizes = np.bincount(window_of)
    assert sizes[:-1].min() >= 20 and sizes.sum() == 328
    for w in range(len(sizes)):
        groups = np.unique(group_of[order[window_of == w]])
        assert GROUPS[groups].sum() == sizes[w]  # whole groups, each in one window
    # Shuffled within a window: not the groups' own row order.
    first = order[window_of == 0]
    assert not np.array_equal(first, np.sort(first))
    with pytest.raises(ValueError, match="row groups of 328 samples for a split of 300"):
        epoch_order(300, 0, 0, windows)


@pytest.mark.parametrize(("world", "stops"), [(1, []), (2, [48]), (4, [96, 240])])
def test_resuming_a_windowed_epoch_anywhere_trains_every_sample_once_on_its_batch(world, stops):
    windows = ShuffleWindows.of_groups(GROUPS, window=20)
    plan = EpochPlan(num_samples=328, global_batch_size=16, seed=5, windows=windows)
    ids = _trained(plan, epoch=2, world=world, stops=stops)
    order = epoch_order(328, 5, 2, windows)[: plan.samples_per_epoch]
    assert len(ids) == len(set(ids)) == plan.samples_per_epoch == 320
    for k in range(plan.steps_per_epoch):  # global batch k is the order's, at any world size
        assert sorted(ids[k * 16 : (k + 1) * 16]) == sorted(order[k * 16 : (k + 1) * 16])


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """72 training images as shards of 24 rows in row groups of 4 (ftjob's writer, shuffled)."""
    root = tmp_path_factory.mktemp("grouped")
    tree = make_image_tree(root / "tree", size=8)
    convert(str(tree), str(root / "shards"), 24, rows_per_group=4)
    return root / "shards"


def _group_reads(shards: Path, window: int, world: int, epoch: int) -> list[dict[Any, int]]:
    """Per rank: reads of every row group's image column chunk while the rank decodes its
    samples of ``epoch`` in blocks of 8, as a stream does, in a process of its own; and -1
    for a group whose rows the rank does not train."""
    ds = ParquetDataset(
        str(shards), image_size=8, resize_size=8, augment=False, shuffle_window=window
    )
    fs = ds._fs = CountingFS()
    catalog = ds.catalog(TRAIN)
    plan = epoch_plan(ds, catalog, type("T", (), {"global_batch_size": 8, "seed": 1})())
    assert (plan.windows is None) == (window == 0)
    out = []
    for rank in range(world):
        row_groups._caches.clear()  # each rank a process of its own
        fs.reads.clear()
        ids = plan.shard(epoch, 0, rank, world)
        rows = catalog.take(pa.array(ids))
        for start in range(0, len(ids), 8):
            block = {
                k: np.asarray(v, dtype=object if k == SHARD else None)
                for k, v in rows.slice(start, 8).to_pydict().items()
            }
            images, skipped = ds.decode_batch(block, TRAIN, epoch, seed=1)
            assert images.shape == (len(block["id"]), 3, 8, 8) and not skipped.any()
        needed = set(
            zip(rows.column(SHARD).to_pylist(), rows.column(GROUP).to_pylist(), strict=True)
        )
        counts = {}
        for path in sorted({str(p) for p in catalog.column(SHARD).to_pylist()}):
            for g, chunk in enumerate(image_chunks(path)):
                reads = sum(overlaps([r], chunk) for r in fs.reads.get(path, []))
                counts[(path, g)] = reads if (path, g) in needed else -1 - reads
        assert len(counts) == 18
        out.append(counts)
    return out


def test_a_window_reads_each_row_group_once_where_a_whole_split_order_reads_them_again(
    grouped: Path,
):
    # Windows of 16 samples (4 groups): a rank reads each group it needs once in the epoch,
    # and no other.
    (one,) = _group_reads(grouped, 16, world=1, epoch=0)
    assert set(one.values()) == {1}
    for counts in _group_reads(grouped, 16, world=2, epoch=1):
        assert set(counts.values()) <= {1, -1} and 1 in counts.values()
    # The whole split shuffled (0): a block of 8 samples reads ~8 of the 18 groups.
    (whole,) = _group_reads(grouped, 0, world=1, epoch=0)
    assert sum(whole.values()) > 2 * len(whole)


def test_a_bad_shuffle_window_is_refused_naming_the_key(tmp_path: Path):
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ConfigError, match=r"dataset\.shuffle_window.*0 to shuffle every"):
            ParquetDataset(str(tmp_path), shuffle_window=bad)  # type: ignore[arg-type]


def test_threads_wanting_one_row_group_at_once_read_it_once():
    cache, started, reads = RowGroupCache(capacity=8), threading.Barrier(4), []

    def read() -> list[Any]:
        reads.append(1)
        return [b"x"] * 4

    def want() -> None:
        started.wait()
        assert cache.get(("s", 0), 4, read) == [b"x"] * 4

    threads = [threading.Thread(target=want) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 == cache.reads
    for g in range(1, 4):  # 12 rows held beyond the 8: the oldest goes, the rest stay
        cache.get(("s", g), 4, read)
    assert cache.get(("s", 3), 4, read) and cache.reads == 4
    cache.get(("s", 0), 4, read)
    assert cache.reads == 5


def test_gpu_workers_decode_with_the_cpus_they_reserve_but_one():
    assert decode_threads(use_gpu=True, worker_cpus=8) == 7
    assert decode_threads(use_gpu=False, worker_cpus=8) == 1  # CPU training uses its cores
    # The KubeRay example: 10-CPU nodes of 8 GPUs, 8 CPUs a worker -> each worker's pool.
    here, why = decode_in_worker(
        "auto", True, cores=10, local_workers=1, worker_cpus=8.0, one_machine=False
    )
    assert here and "7 thread(s)" in why
    # One CPU reserved: nothing to decode with in the worker.
    here, why = decode_in_worker("auto", True, cores=64, local_workers=8, worker_cpus=1.0)
    assert not here and "Ray Data" in why
    # A one-machine cluster leaving Ray Data more cores a worker than the pool would have.
    here, why = decode_in_worker("auto", True, cores=64, local_workers=2, worker_cpus=4.0)
    assert not here and "28 unreserved cores a worker" in why
    assert decode_in_worker("auto", True, cores=12, local_workers=2, worker_cpus=4.0)[0]


def test_a_pool_of_decode_threads_gives_the_window_one_thread_gives(grouped: Path):
    from ftjob.data.streams import InProcessStream, _Decode

    ds = ParquetDataset(str(grouped), image_size=8, resize_size=8, shuffle_window=16)
    catalog = ds.catalog(TRAIN)
    rows = catalog.take(pa.array(epoch_order(catalog.num_rows, 0, 0, ds.shuffle_windows(catalog))))
    blocks = [rows.slice(i, 8) for i in range(0, rows.num_rows, 8)]  # 9 blocks, 3 threads
    got = []
    for threads in (1, 3):
        row_groups._caches.clear()
        stream = InProcessStream(ds, catalog, TRAIN, seed=0, threads=threads)
        got.append(stream._decode(blocks, _Decode(ds, TRAIN, 0, 0)).columns)
    assert got[0].keys() == got[1].keys() and len(got[0]["id"]) == 72
    for key, values in got[0].items():
        assert np.array_equal(values, got[1][key]), key
