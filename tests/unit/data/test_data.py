"""The order function and exact-once slicing (no Ray)."""

from __future__ import annotations

import collections
import io
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from ftjob.data.datasets import (
    TRAIN,
    VAL,
    DigitsDataset,
    ImageFolderDataset,
    SyntheticDataset,
    sample_rng,
)
from ftjob.data.order import EpochPlan, epoch_order, validation_ids
from ftjob.data.streams import (
    EPOCH_END,
    Batch,
    BatchFeeder,
    ValidationSet,
    WindowSizer,
    decode_in_worker,
)


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    a = epoch_order(1000, seed=3, epoch=2)
    assert np.array_equal(a, epoch_order(1000, seed=3, epoch=2))
    assert sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, epoch_order(1000, seed=3, epoch=3))
    assert not np.array_equal(a, epoch_order(1000, seed=4, epoch=2))


def _trained(plan: EpochPlan, epoch: int, world: int, stops: list[int]) -> list[int]:
    """Ids trained in an epoch interrupted at each position in ``stops`` (each attempt resumes
    at the previous stop), with ``world`` workers."""
    out: list[int] = []
    bounds = [0, *stops, plan.samples_per_epoch]
    b = plan.global_batch_size // world
    for start, stop in zip(bounds, bounds[1:], strict=False):
        shards = [plan.shard(epoch, start, r, world) for r in range(world)]
        for k in range((stop - start) // plan.global_batch_size):
            for r in range(world):
                out.extend(shards[r][k * b : (k + 1) * b].tolist())
    return out


@pytest.mark.parametrize("stops", [[], [64], [64, 320], [0, 576]])
def test_resuming_anywhere_trains_every_sample_once(stops):
    plan = EpochPlan(num_samples=650, global_batch_size=64, seed=0)
    ids = _trained(plan, epoch=1, world=2, stops=stops)
    expected = epoch_order(650, 0, 1)[: plan.samples_per_epoch]
    assert len(ids) == len(set(ids)) == plan.samples_per_epoch == 640
    assert sorted(ids) == sorted(expected.tolist())


def test_global_batch_k_is_the_same_whatever_the_world_size():
    plan = EpochPlan(num_samples=512, global_batch_size=64, seed=7)
    two = _trained(plan, 0, world=2, stops=[128])
    four = _trained(plan, 0, world=4, stops=[256])
    for k in range(plan.steps_per_epoch):  # same samples per global batch, any split
        assert sorted(two[k * 64 : (k + 1) * 64]) == sorted(four[k * 64 : (k + 1) * 64])


def test_dropped_tail_is_the_same_in_every_attempt():
    plan = EpochPlan(num_samples=100, global_batch_size=32, seed=1)
    tail = set(epoch_order(100, 1, 0)[96:].tolist())
    assert tail.isdisjoint(_trained(plan, 0, 1, [32])) and tail.isdisjoint(_trained(plan, 0, 2, []))


def test_bad_positions_and_sizes_are_refused():
    plan = EpochPlan(num_samples=100, global_batch_size=32, seed=0)
    with pytest.raises(ValueError, match="step boundary"):
        plan.shard(0, 33, 0, 1)
    with pytest.raises(ValueError, match="does not split"):
        plan.shard(0, 0, 0, 3)
    with pytest.raises(ValueError, match="trainer.batch_size"):
        EpochPlan(num_samples=10, global_batch_size=64, seed=0)


def test_validation_shards_cover_the_set_once():
    parts = [validation_ids(359, r, 4) for r in range(4)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(359))


class _LocalStream:
    """The synthetic dataset decoded in-process (no Ray): counts the passes it streams."""

    def __init__(self, fail: bool = False) -> None:
        self.dataset = SyntheticDataset(num_samples=64, num_val_samples=40, image_size=8)
        self.catalog = self.dataset.catalog(VAL)
        self.passes, self.fail, self.batches_decoded = 0, fail, 0

    def batches(self, ids, batch_size, epoch):
        self.passes += 1
        for i in range(0, len(ids), batch_size):
            if self.fail:
                raise OSError("connection reset by peer")
            self.batches_decoded += 1
            chunk = ids[i : i + batch_size]
            rows = _rows(self.catalog.take(pa.array(chunk)), len(chunk))
            images = torch.from_numpy(self.dataset.decode(rows, VAL, epoch, 0))
            yield Batch(images, torch.from_numpy(rows["label"].astype(np.int64)), rows["id"])


def _ids(batches):
    return np.concatenate([b.ids for b in batches]).tolist()


def test_validation_set_prefetches_once_and_serves_every_validation_from_memory():
    stream = _LocalStream()
    val = ValidationSet(stream, validation_ids(40, 1, 2), batch_size=8, cache_bytes=2**20)
    val.prefetch()
    first, second = list(val), list(val)
    assert stream.passes == 1
    assert _ids(first) == _ids(second) == list(range(20, 40))
    assert all(torch.equal(a.images, b.images) for a, b in zip(first, second, strict=True))


def test_validation_set_too_big_to_cache_streams_every_time_and_says_so_at_once():
    stream = _LocalStream()
    one_batch = 8 * 3 * 8 * 8 * 4
    notes: list[str] = []
    val = ValidationSet(
        stream, validation_ids(40, 0, 2), batch_size=8, cache_bytes=one_batch, note=notes.append
    )
    val.prefetch()
    assert _ids(val) == _ids(val) == list(range(20))
    assert stream.passes == 3  # the abandoned prefetch, then one pass per validation
    assert stream.batches_decoded == 1 + 3 + 3  # the prefetch stopped at its first batch
    [note] = notes
    assert "trainer.validation_cache_mb=0" in note and "every validation decodes it again" in note
    val.prefetch()  # does not try again
    assert stream.passes == 3


def test_validation_set_prefetch_error_surfaces_at_validation():
    val = ValidationSet(_LocalStream(fail=True), np.arange(10), batch_size=4, cache_bytes=2**20)
    val.prefetch()
    with pytest.raises(OSError, match="connection reset"):
        list(val)


class _Epochs:
    """Three batches per epoch. With ``gate_until``, the last batch of each epoch before it is
    produced only once the next epoch's stream has started (or after 5 s, noted in ``late``)."""

    def __init__(self, fail_in_epoch: int | None = None, gate_until: int = 0) -> None:
        self.fail_in_epoch, self.gate_until = fail_in_epoch, gate_until
        self.started: dict[int, threading.Event] = collections.defaultdict(threading.Event)
        self.late: list[int] = []

    def epoch(self, epoch, position):
        self.started[epoch].set()
        for k in range(position, 3):
            if epoch == self.fail_in_epoch and k == 1:
                raise ValueError(f"undecodable image in epoch {epoch}")
            if epoch < self.gate_until and k == 2 and not self.started[epoch + 1].wait(5):
                self.late.append(epoch)
            yield f"e{epoch}b{k}"


def _feeder(source, first_epoch, position, epochs, depth=2, lookahead=2):
    return BatchFeeder(
        source,
        source.epoch(first_epoch, position),
        first_epoch,
        epochs,
        depth,
        first_steps=3 - position,
        steps_per_epoch=3,
        lookahead=lookahead,
    )


def test_batch_feeder_streams_across_epochs_with_markers():
    feeder = _feeder(_Epochs(), first_epoch=1, position=2, epochs=3)
    items = list(feeder)
    feeder.close()
    assert items == [
        (1, "e1b2"),
        (1, EPOCH_END),
        (2, "e2b0"),
        (2, "e2b1"),
        (2, "e2b2"),
        (2, EPOCH_END),
    ]


def test_batch_feeder_starts_the_next_epoch_before_the_current_one_ends():
    source = _Epochs(gate_until=2)
    feeder = _feeder(source, first_epoch=0, position=0, epochs=3, lookahead=2)
    items = [batch for _, batch in feeder if batch is not EPOCH_END]
    feeder.close()
    assert items == [f"e{e}b{k}" for e in range(3) for k in range(3)]
    assert source.late == []


def test_batch_feeder_reraises_the_stream_error_on_the_training_thread():
    feeder = _feeder(_Epochs(fail_in_epoch=1), first_epoch=0, position=0, epochs=2, depth=1)
    seen = []
    with pytest.raises(ValueError, match="undecodable image in epoch 1"):
        for item in feeder:
            seen.append(item)
    feeder.close()
    assert seen[-1] == (1, "e1b0")


def _all_windows(sizer, block_bytes):
    out = []
    while (window := sizer.next_window()) is not None:
        out.append(window)
        sizer.observe(block_bytes * (window[1] - window[0]), window[1] - window[0])
    return out


def test_batches_decode_in_the_training_process_where_ray_data_has_no_core_to_use():
    # auto: CPU training that holds every core of a one-machine cluster decodes in-process.
    here, why = decode_in_worker("auto", False, cores=2, local_workers=2, worker_cpus=1.0)
    assert here and "2 cores for 2 CPU training workers" in why and "none to spare" in why
    assert decode_in_worker("auto", False, cores=8, local_workers=2, worker_cpus=4.0)[0]
    # Less than one decode task's CPUs to spare is none.
    assert decode_in_worker("auto", False, 2, 1, worker_cpus=1.5)[0]
    assert decode_in_worker("auto", False, 4, 2, 1.0, decode_cpus=3.0)[0]
    # A core to spare, a GPU, or other machines in the cluster: Ray Data.
    assert decode_in_worker("auto", False, cores=2, local_workers=1, worker_cpus=1.0) == (
        False,
        "1 of 2 cores on this machine to spare beside the training",
    )
    assert not decode_in_worker("auto", True, cores=2, local_workers=2, worker_cpus=1.0)[0]
    assert decode_in_worker("auto", False, 2, 2, 1.0, one_machine=False) == (
        False,
        "the cluster has other machines for Ray Data's decode tasks",
    )
    # Said in config, it is what is done.
    assert decode_in_worker("ray", False, 2, 2, 1.0) == (False, "trainer.decode_in=ray")
    assert decode_in_worker("worker", True, 64, 1, 1.0) == (True, "trainer.decode_in=worker")


def test_decode_windows_start_small_grow_and_stay_within_budget():
    MB = 2**20
    windows = _all_windows(WindowSizer(budget_bytes=64 * MB, num_blocks=100), block_bytes=MB)
    sizes = [b - a for a, b in windows]
    assert sizes[:5] == [1, 2, 4, 8, 16]  # the first batch waits for one block only
    assert max(sizes) == 32  # two windows in flight stay within 64 MB
    assert windows[0][0] == 0 and windows[-1][1] == 100
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(windows[:-1], windows[1:], strict=True))
    # blocks bigger than half the budget: one block per window, never zero
    assert {b - a for a, b in _all_windows(WindowSizer(MB, 5), block_bytes=4 * MB)} == {1}


def _rows(table, n):
    return {
        name: table.column(name).to_numpy(zero_copy_only=False)[:n] for name in table.column_names
    }


def test_digits_catalog_split_is_fixed_and_disjoint():
    ds = DigitsDataset()
    train, val = ds.catalog(TRAIN), ds.catalog(VAL)
    assert train.num_rows + val.num_rows == 1797
    assert train.column("id").to_pylist() == list(range(train.num_rows))
    assert ds.catalog(VAL).equals(val)
    labels = val.column("label").to_numpy()
    assert set(np.bincount(labels).tolist()) <= {35, 36, 37}  # stratified: ~20% of each class
    images = ds.decode(_rows(train, 4), TRAIN, epoch=0, seed=0)
    assert images.shape == (4, 3, 32, 32) and images.dtype == np.float32
    assert -1.0 <= images.min() and images.max() <= 1.0


def test_synthetic_images_depend_only_on_the_sample():
    ds = SyntheticDataset(num_samples=16, num_val_samples=4, image_size=8, num_classes=3)
    cat = ds.catalog(TRAIN)
    a = ds.decode(_rows(cat, 4), TRAIN, epoch=0, seed=0)
    b = ds.decode(_rows(cat, 4), TRAIN, epoch=5, seed=9)
    assert a.shape == (4, 3, 8, 8) and np.array_equal(a, b)
    assert not np.array_equal(
        ds.catalog(VAL).column("key").to_numpy(), cat.column("key").to_numpy()[:4]
    )


def test_imagefolder_lists_decodes_and_augments_per_sample(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(
                    tmp_path / split / cls / f"{i}.png"
                )
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    ds = ImageFolderDataset(path=str(tmp_path), image_size=16, resize_size=20)
    train = ds.catalog(TRAIN)
    assert ds.num_classes == 2 and train.num_rows == 6
    assert train.column("label").to_pylist() == [0, 0, 0, 1, 1, 1]
    rows = _rows(train, 6)
    first = ds.decode(rows, TRAIN, epoch=0, seed=0)
    assert first.shape == (6, 3, 16, 16) and first.dtype == np.uint8  # normalised on the device
    assert ds.normalisation() == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert np.array_equal(first, ds.decode(rows, TRAIN, epoch=0, seed=0))  # same (seed, epoch, id)
    assert not np.array_equal(first, ds.decode(rows, TRAIN, epoch=1, seed=0))
    val = ds.decode(_rows(ds.catalog(VAL), 2), VAL, epoch=3, seed=1)
    assert np.array_equal(val, ds.decode(_rows(ds.catalog(VAL), 2), VAL, epoch=0, seed=0))
    with pytest.raises(ValueError, match="num_classes"):
        _ = ImageFolderDataset(path=str(tmp_path), num_classes=1000).num_classes
    with pytest.raises(FileNotFoundError, match="no images"):
        ImageFolderDataset(path=str(tmp_path / "missing")).catalog(TRAIN)


def test_uint8_images_are_normalised_on_the_device_float_images_pass_as_they_are(tmp_path):
    from ftjob.data.streams import RayDataStream

    ds = ImageFolderDataset(path=str(tmp_path), mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.5))
    stream = RayDataStream(ds, pa.table({"id": [0]}), VAL, seed=0)
    raw = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mean = torch.tensor([0.4, 0.5, 0.6]).reshape(1, 3, 1, 1)
    std = torch.tensor([0.2, 0.25, 0.5]).reshape(1, 3, 1, 1)
    normalised = stream._normalised(raw)
    assert normalised.dtype == torch.float32
    torch.testing.assert_close(normalised, (raw.float() / 255 - mean) / std)
    already = torch.randn(2, 3, 4, 4)
    assert stream._normalised(already) is already


def test_a_large_jpeg_decodes_at_a_reduced_scale_with_the_same_crop(tmp_path):
    """PIL's draft mode: a 1024 px JPEG whose crop is shrunk to 32 px decodes at 1/8 scale;
    the picture is the same one, up to the JPEG's own reduced-scale rounding."""
    from PIL import Image

    yy, xx = np.mgrid[0:1024, 0:1024]
    smooth = np.stack([xx % 256, yy % 256, (xx + yy) % 256], axis=-1).astype(np.uint8)
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        Image.fromarray(smooth).save(tmp_path / split / "a" / "big.jpg", quality=95)
        Image.fromarray(smooth).save(tmp_path / split / "a" / "big.png")
    ds = ImageFolderDataset(path=str(tmp_path), image_size=32, resize_size=36, num_classes=None)
    rows = _rows(ds.catalog(VAL), 2)
    assert [str(p).rsplit(".", 1)[1] for p in rows["path"]] == ["jpg", "png"]
    jpeg, png = ds.decode(rows, VAL, epoch=0, seed=0)  # the PNG is decoded at full size
    assert np.abs(jpeg.astype(int) - png.astype(int)).mean() < 2
    from ftjob.data.datasets import _draft

    with Image.open(tmp_path / "val" / "a" / "big.jpg") as img:
        drafted, factor = _draft(img, 1024 / 36)
        assert drafted.size == (128, 128) and factor == 1 / 8  # 1/8 still has >= 36 px a side
    with Image.open(tmp_path / "val" / "a" / "big.png") as img:
        assert _draft(img, 1024 / 36) == (img, 1.0)  # not a JPEG: decoded as it is


def test_a_drafted_crop_that_reaches_the_edge_of_an_odd_sized_jpeg_stays_inside_it(
    tmp_path, monkeypatch
):
    """1001 x 800 at 1/2 scale is 501 x 400 (PIL rounds up): a crop box to the bottom-right
    corner scaled by 501/1001 would end past the image; by the true 1/2 it ends at its edge."""
    from PIL import Image

    data = io.BytesIO()
    Image.fromarray(np.full((800, 1001, 3), 128, dtype=np.uint8)).save(data, format="JPEG")
    ds = ImageFolderDataset(path=str(tmp_path), image_size=224, augment=True)
    monkeypatch.setattr(ds, "_crop_box", lambda w, h, rng: (201, 0, 1001, 800))
    out = ds._transform(data.getvalue(), True, np.random.default_rng(0))
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8


def test_sample_rng_does_not_depend_on_batching():
    assert sample_rng(1, 2, 3).random() == sample_rng(1, 2, 3).random()
    assert sample_rng(1, 2, 3).random() != sample_rng(1, 2, 4).random()


def test_validation_cut_short_by_a_notice_does_not_count():
    import torch

    from ftjob.data.streams import Batch
    from ftjob.worker.validation import evaluate

    model = torch.nn.Linear(4, 2)
    batches = [Batch(torch.ones(3, 4), torch.zeros(3, dtype=torch.int64), None) for _ in range(4)]
    *_, count, complete = evaluate(model, batches, torch.device("cpu"), False, 1)
    assert (count, complete) == (12, True)
    polls = iter([False, False, True])  # the notice arrives before the third batch
    *_, complete = evaluate(model, batches, torch.device("cpu"), False, 1, lambda: next(polls))
    assert not complete and model.training  # back in training mode either way


@pytest.mark.ray
def test_a_first_window_decoded_in_the_process_gives_ray_datas_batches(tmp_path, monkeypatch):
    # A restarted worker decodes its first window itself instead of waiting for Ray Data's
    # decode processes: the same rows, images, labels and batch boundaries, uint8 images
    # normalised on the device as well as float32 ones.
    import ray

    from ftjob.data.streams import LocalWindow, RayDataStream
    from tests.support.images import make_image_tree

    local_rows = []
    decode_here = LocalWindow.decode.__func__

    def counted(cls, blocks, decode):  # the real decode, counted
        local_rows.append(sum(b.num_rows for b in blocks))
        return decode_here(cls, blocks, decode)

    monkeypatch.setattr(LocalWindow, "decode", classmethod(counted))
    folder = ImageFolderDataset(
        path=str(make_image_tree(tmp_path, train_per_class=100)),
        mean=(0.4, 0.5, 0.6),
        std=(0.2, 0.25, 0.5),
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        for ds, batch_size in ((folder, 32), (DigitsDataset(), 48)):
            ids = epoch_order(ds.catalog(TRAIN).num_rows, seed=1, epoch=0)[:200]
            got, local_rows[:] = {}, []
            for local in (False, True):
                stream = RayDataStream(
                    ds, ds.catalog(TRAIN), TRAIN, seed=1, local_first_window=local
                )
                got[local] = list(stream.batches(ids, batch_size, epoch=0))
            assert local_rows == [batch_size * (128 // batch_size)]  # one block, then Ray Data
            assert len(got[True]) > 128 // batch_size + 1  # the rest came from Ray Data
            assert [len(b.ids) for b in got[True]] == [len(b.ids) for b in got[False]]
            assert np.array_equal(np.concatenate([b.ids for b in got[True]]), ids)
            for a, b in zip(got[True], got[False], strict=True):
                assert np.array_equal(a.ids, b.ids)
                assert torch.equal(a.labels, b.labels) and a.labels.dtype == torch.int64
                assert a.images.dtype == torch.float32
                torch.testing.assert_close(a.images, b.images, rtol=0, atol=0)
    finally:
        ray.shutdown()


class _Ledger:
    """The run ledger's calls a worker makes about a fatal error (no Ray)."""

    def __init__(self, fatal: str | None = None) -> None:
        self.fatal, self.calls = fatal, []
        ledger = self

        class Call:
            def __init__(self, name):
                self.name = name

            def remote(self, *args):
                ledger.calls.append(self.name)
                if self.name == "set_fatal":
                    ledger.fatal = ledger.fatal or args[0]
                    return None
                return {"fatal": ledger.fatal}

        self.set_fatal = Call("set_fatal")


def test_a_data_error_is_the_runs_fatal_error_and_ends_every_rank():
    from ftjob.data.datasets import DataError
    from ftjob.worker.loop import end_on_data_error
    from ftjob.worker.recorder import RunRecorder

    def recorder(ledger):
        return RunRecorder(ledger, rank=1, resolve=lambda value, timeout=None: value)

    line = "dataset file /d/train/cat/x.jpg cannot be decoded as an image (...): remove or fix it"
    try:
        raise RuntimeError("UDF failed to process a data block.") from DataError(line)
    except RuntimeError as exc:
        wrapped = exc
    alone = _Ledger()  # one worker: it records the error and returns, the job ends
    end_on_data_error(wrapped, recorder(alone), world=1)
    assert alone.fatal == line
    # Several: the other ranks wait in a collective with this one; the attempt fails so that
    # Ray Train ends the group, and the restart ends at its start.
    group = _Ledger()
    with pytest.raises(DataError) as err:
        end_on_data_error(wrapped, recorder(group), world=2)
    assert str(err.value) == group.fatal == line
    from ftjob.driver.ledger import RunLedger
    from ftjob.record import RunPlan

    ledger = RunLedger(RunPlan())
    assert ledger.start_attempt(0.0, 2).stop is None
    ledger.set_fatal(line)
    assert ledger.start_attempt(1.0, 2).stop == line  # the restart ends at its start
    # Any other error is raised again: a failure, Ray Train's to retry.
    other, reset = _Ledger(), ConnectionResetError("connection reset by peer")
    with pytest.raises(ConnectionResetError) as err:
        end_on_data_error(reset, recorder(other), world=2)
    assert err.value is reset and other.calls == []
    assert group.calls == ["set_fatal"]
