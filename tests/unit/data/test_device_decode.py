"""Decoding on the device (``trainer.decode_in=device``), run here with ``device="cpu"``: the
same functions, batch layout and crop parameters as on a GPU, with libjpeg-turbo where a GPU
has nvJPEG. Real JPEGs of ImageNet's shape (tests/support/images.py: 400x350, ~110 KB,
quality 90) against the worker's PIL path.

The tolerance, in uint8 levels of the decoded images: on the CPU none -- the device path's
pixels are the PIL path's, byte for byte (both decode with libjpeg-turbo; the resize is
Pillow's arithmetic in integers). On a GPU nvJPEG's inverse DCT and chroma upsampling differ
from libjpeg-turbo's: the GPU test below bounds the mean difference by 1 level."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ftjob import metrics as M
from ftjob.data.clock import DataClock
from ftjob.data.datasets import TRAIN, VAL, DataError, ImageFolderDataset
from ftjob.data.device_decode import DeviceDecoder
from ftjob.data.headers import read_header
from ftjob.data.resample import geometry, resample, val_geometry
from ftjob.data.streams import DeviceStream, InProcessStream, numpy_rows
from tests.support.images import awkward_files, exif_orientation, jpeg, photo_like, photo_tree

SIZE, RESIZE = 224, 256
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG)")


def dataset(root: Path, **options: object) -> ImageFolderDataset:
    return ImageFolderDataset(path=str(root), image_size=SIZE, resize_size=RESIZE, **options)


def batches(stream: object, ids: np.ndarray, epoch: int) -> list:
    return list(stream.batches(ids, 4, epoch))  # type: ignore[attr-defined]


def uint8(images: torch.Tensor, ds: ImageFolderDataset) -> np.ndarray:
    """Normalised batches back to the decoded levels they were made from."""
    mean, std = (torch.tensor(v).reshape(1, 3, 1, 1) * 255 for v in ds.normalisation())
    return (images.cpu() * std + mean).round().to(torch.uint8).numpy()


@pytest.mark.parametrize("split", [TRAIN, VAL])
def test_the_device_path_makes_the_pil_paths_pixels_from_imagenet_like_jpegs(tmp_path, split):
    ds = dataset(photo_tree(tmp_path, classes=2, train_per_class=6, val_per_class=4))
    catalog = ds.catalog(split)
    ids = np.random.default_rng(1).permutation(catalog.num_rows)
    device = torch.device("cpu")
    pil = batches(InProcessStream(ds, catalog, split, seed=5, device=device), ids, 2)
    here = DeviceStream(ds, catalog, split, seed=5, device=device)
    made = batches(here, ids, 2)
    assert [b.ids.tolist() for b in made] == [b.ids.tolist() for b in pil]
    a, b = (np.concatenate([uint8(x.images, ds) for x in got]) for got in (pil, made))
    diff = np.abs(a.astype(int) - b.astype(int))
    assert diff.max() == 0, f"mean {diff.mean():.4f}, max {diff.max()} levels"
    assert here.clock.get(M.DATA_DEVICE_DECODED) == len(ids)
    assert all(here.clock.get(key) == 0 for key in M.DATA_FALLBACKS)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_before_the_crop_as_pil_applies_it(tmp_path, orientation):
    folder = tmp_path / TRAIN / "a"
    folder.mkdir(parents=True)
    (tmp_path / VAL / "a").mkdir(parents=True)
    pixels = photo_like(7, width=300, height=200)
    (folder / "0.jpg").write_bytes(jpeg(pixels, exif=exif_orientation(orientation)))
    (tmp_path / VAL / "a" / "0.jpg").write_bytes(jpeg(pixels))
    ds = dataset(tmp_path)
    ds.image_size, ds.resize_size = 96, 110
    rows = numpy_rows(ds.catalog(TRAIN))
    for split in (TRAIN, VAL):
        decoder = DeviceDecoder(ds, split, 3, 0, "cpu", DataClock())
        prepared = decoder.prepare(rows)
        made = decoder.batch(prepared, 0, 1)["image"][0].permute(1, 2, 0).numpy()
        data = (folder / "0.jpg").read_bytes()
        expected = ds.decode_encoded(data, "0.jpg", split == TRAIN, _rng(3, 0))
        assert np.array_equal(made, expected), (split, orientation)


def _rng(epoch: int, sample: int) -> np.random.Generator:
    from ftjob.data.datasets import sample_rng

    return sample_rng(0, epoch, sample)


def awkward_tree(root: Path) -> dict[str, Path]:
    """Four good JPEGs and one file of each awkward kind, in one class folder: one batch."""
    folder = root / TRAIN / "a"
    folder.mkdir(parents=True)
    (root / VAL / "a").mkdir(parents=True)
    (root / VAL / "a" / "v.jpg").write_bytes(jpeg(photo_like(99)))
    for i in range(4):
        (folder / f"good{i}.jpg").write_bytes(jpeg(photo_like(i)))
    files = {}
    for kind, data in awkward_files(photo_like(50)).items():
        files[kind] = folder / f"{kind}.{'png' if kind == 'png' else 'jpg'}"
        files[kind].write_bytes(data)
    # Cut where a JPEG's end marker would be found, but corrupt inside: a Huffman table
    # marker in the middle of its scan. Headers take it; the decoder refuses it (so does PIL).
    refused = bytearray(jpeg(photo_like(60)))
    at = refused.index(b"\xff\xda") + (len(refused) - refused.index(b"\xff\xda")) // 2
    refused[at : at + 2] = b"\xff\xc4"
    files["refused"] = folder / "refused.jpg"
    files["refused"].write_bytes(bytes(refused))
    return files


def test_awkward_files_in_one_batch_fall_back_by_reason_and_a_bad_one_is_skipped(tmp_path):
    files = awkward_tree(tmp_path)
    ds = dataset(tmp_path, bad_files="skip")
    catalog = ds.catalog(TRAIN)
    rows = numpy_rows(catalog)
    clock = DataClock()
    decoder = DeviceDecoder(ds, TRAIN, 0, 0, "cpu", clock)
    prepared = decoder.prepare(rows)
    batch = decoder.batch(prepared, 0, len(prepared))
    names = [Path(p).name for p in rows["path"]]
    skipped = {names[k] for k in np.flatnonzero(batch["skipped"].numpy())}
    assert skipped == {"truncated.jpg", "refused.jpg"}
    counts = {key[len(M.DATA_FALLBACK) :]: clock.get(key) for key in M.DATA_FALLBACKS}
    assert counts == {
        "format": 1,  # the PNG
        "progressive": 1,
        "cmyk": 1,
        "layout": 0,
        "truncated": 1,
        "refused": 1,  # found by halving the batch the device's decoder failed on
    }
    assert clock.get(M.DATA_DEVICE_DECODED) == 4
    # Every image that was decoded is the PIL path's, whichever decoder made it.
    for k, name in enumerate(names):
        if name in skipped:
            assert not batch["image"][k].any()
            continue
        data = Path(rows["path"][k]).read_bytes()
        expected = ds.decode_encoded(data, name, True, _rng(0, int(rows["id"][k])))
        assert np.array_equal(batch["image"][k].permute(1, 2, 0).numpy(), expected), name
    assert read_header(files["png"].read_bytes(), None).fallback == "format"


def test_with_bad_files_fail_the_batch_names_the_truncated_file(tmp_path):
    files = awkward_tree(tmp_path)
    files["refused"].unlink()
    ds = dataset(tmp_path)  # bad_files=fail
    decoder = DeviceDecoder(ds, TRAIN, 0, 0, "cpu", DataClock())
    with pytest.raises(DataError) as raised:
        decoder.prepare(numpy_rows(ds.catalog(TRAIN)))
    assert str(files["truncated"]) in str(raised.value)
    assert "dataset.bad_files=skip" in str(raised.value)


def test_a_file_the_batched_decoder_refuses_alone_is_found_and_named(tmp_path):
    files = awkward_tree(tmp_path)
    for kind in ("png", "cmyk", "progressive", "truncated"):
        files[kind].unlink()
    ds = dataset(tmp_path)
    decoder = DeviceDecoder(ds, TRAIN, 0, 0, "cpu", DataClock())
    prepared = decoder.prepare(numpy_rows(ds.catalog(TRAIN)))  # the headers take all five
    assert sum(g is not None for g in prepared.geoms) == 5
    with pytest.raises(DataError) as raised:
        decoder.batch(prepared, 0, len(prepared))
    assert str(files["refused"]) in str(raised.value)


def test_a_batch_of_large_photos_is_resized_in_chunks_with_the_same_pixels(tmp_path, monkeypatch):
    from ftjob.data import resample

    ds = dataset(photo_tree(tmp_path, classes=1, train_per_class=4, val_per_class=1))
    rows = numpy_rows(ds.catalog(TRAIN))
    decoder = DeviceDecoder(ds, TRAIN, 1, 0, "cpu", DataClock())
    prepared = decoder.prepare(rows)
    whole = decoder.batch(prepared, 0, 4)["image"]
    monkeypatch.setattr(resample, "CHUNK_PIXELS", 1)  # one image a chunk
    assert torch.equal(decoder.batch(prepared, 0, 4)["image"], whole)


def test_validation_geometry_is_pils_resize_then_centre_crop():
    data = jpeg(photo_like(3, width=333, height=251))
    img = Image.open(io.BytesIO(data)).convert("RGB")
    g = val_geometry(img.size, 96, 120, 1)
    assert (len(g.xi), len(g.yi)) == (96, 96)
    assert 0 <= g.x0 < g.x1 <= 333 and 0 <= g.y0 < g.y1 <= 251


@GPU
def test_on_a_gpu_the_same_bytes_make_the_same_pixels_close_to_the_pil_paths(tmp_path):
    ds = dataset(photo_tree(tmp_path, classes=2, train_per_class=8, val_per_class=2))
    catalog = ds.catalog(TRAIN)
    ids = np.arange(catalog.num_rows)
    device = torch.device("cuda")
    pil = batches(InProcessStream(ds, catalog, TRAIN, seed=5, device=device), ids, 0)
    first, second = (
        [
            b.settle()
            for b in batches(DeviceStream(ds, catalog, TRAIN, seed=5, device=device), ids, 0)
        ]
        for _ in range(2)
    )
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.images, b.images)  # deterministic: the same bytes, the same pixels
    a, b = (np.concatenate([uint8(x.images, ds) for x in got]) for got in (pil, first))
    diff = np.abs(a.astype(int) - b.astype(int))
    print(f"nvJPEG against PIL: mean {diff.mean():.3f}, max {diff.max()} levels")
    assert diff.mean() <= 1.0


def test_synthetic_images_made_on_the_device_are_the_workers_bit_for_bit():
    from ftjob.data.datasets import SyntheticDataset

    ds = SyntheticDataset(num_samples=24, num_val_samples=8, image_size=16, num_classes=3)
    catalog = ds.catalog(TRAIN)
    ids = np.random.default_rng(0).permutation(catalog.num_rows)
    device = torch.device("cpu")
    pil = batches(InProcessStream(ds, catalog, TRAIN, seed=1, device=device), ids, 0)
    here = DeviceStream(ds, catalog, TRAIN, seed=1, device=device)
    made = batches(here, ids, 0)
    assert [b.ids.tolist() for b in made] == [b.ids.tolist() for b in pil]
    assert all(torch.equal(a.images, b.images) for a, b in zip(pil, made, strict=True))
    assert here.clock.get(M.DATA_DECODE) > 0  # made by the stream's device path, and timed


def test_a_file_that_cannot_be_read_is_a_bad_file_not_a_fallback(tmp_path):
    ds = dataset(
        photo_tree(tmp_path, classes=1, train_per_class=3, val_per_class=1), bad_files="skip"
    )
    rows = numpy_rows(ds.catalog(TRAIN))
    Path(rows["path"][1]).unlink()  # gone after the catalog listed it
    clock = DataClock()
    prepared = DeviceDecoder(ds, TRAIN, 0, 0, "cpu", clock).prepare(rows)
    assert prepared.skipped.tolist() == [False, True, False]
    assert all(clock.get(key) == 0 for key in M.DATA_FALLBACKS)  # no decoder was asked


def test_a_batch_made_on_the_device_is_not_touched_again_off_its_side_stream(tmp_path, monkeypatch):
    """Its images are the model's input when its side stream finishes them; anything done to
    them after on the feeder thread would run on another stream, not waiting for the batch's
    event. So the model-input step (normalise, layout) runs once a batch, in the decoder."""
    ds = dataset(photo_tree(tmp_path, classes=1, train_per_class=4, val_per_class=1))
    ds.image_size, ds.resize_size = 48, 56
    stream = DeviceStream(ds, ds.catalog(TRAIN), TRAIN, seed=0, device=torch.device("cpu"))
    calls = []
    real = stream._model_input
    monkeypatch.setattr(stream, "_model_input", lambda images: calls.append(1) or real(images))
    made = batches(stream, np.arange(4), 0)
    assert len(made) == 1 and len(calls) == 1


def test_a_crop_whose_outer_taps_weigh_nothing_is_resized_as_pil_resizes_it():
    """Pillow's filter may give an output pixel's outermost tap no weight; that tap's index can
    lie outside the rows and columns the crop reads (its span). It was gathered all the same:
    past the span, into the next image of the batch, or -- for the last image of a chunk --
    out of range (an IndexError on the CPU, a device-side assert that ends the process on a
    GPU), so whether a batch decoded depended on what stood beside the crop in it."""
    pixels = photo_like(4)  # 400x350
    box = (0.0, 0.0, 288.0, 350.0)  # 288 columns to 32: a zero-weight tap at column 288
    g = geometry(box, (32, 32), (0, 0, 32, 32), 1, False, (400, 350))
    image = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
    alone = resample([image], [g], "cpu")  # the last (only) image of its chunk
    pil = Image.fromarray(pixels).resize((32, 32), Image.Resampling.BILINEAR, box=box)
    assert np.array_equal(alone[0].permute(1, 2, 0).numpy(), np.asarray(pil))


def test_batches_of_two_threads_never_share_the_side_stream_at_once(tmp_path, monkeypatch):
    """The next epoch's first batch is made on a helper thread while the feeder makes this
    epoch's last: on one side stream, one batch at a time (interleaved, the allocator could
    hand one thread a block the other's queued decode still writes)."""
    import threading
    import time

    ds = dataset(photo_tree(tmp_path, classes=1, train_per_class=8, val_per_class=1))
    ds.image_size, ds.resize_size = 32, 36
    stream = DeviceStream(ds, ds.catalog(TRAIN), TRAIN, seed=0, device=torch.device("cpu"))
    inside, most = [0], [0]
    real = DeviceDecoder.batch

    def slow(self, p, start, end):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        try:
            return real(self, p, start, end)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(DeviceDecoder, "batch", slow)
    made: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda e=e: made.setdefault(e, batches(stream, np.arange(8), e)))
        for e in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(made[e]) for e in (0, 1)] == [2, 2] and most[0] == 1


def test_a_device_failure_in_the_batched_decode_is_raised_not_taken_for_bad_files(
    tmp_path, monkeypatch
):
    """torchvision re-raises nvJPEG's failures as one RuntimeError: one that says the device
    failed (its memory, a kernel) must stop the batch, not send its files to the CPU decoder
    (other pixels, chosen by memory pressure); one that says the files are bad halves the
    batch as before. And the decode runs without deterministic mode's fill of new tensors."""
    import torch.utils.deterministic as deterministic
    import torchvision.io

    ds = dataset(photo_tree(tmp_path, classes=1, train_per_class=4, val_per_class=1))
    decoder = DeviceDecoder(ds, TRAIN, 0, 0, "cpu", DataClock())
    prepared = decoder.prepare(numpy_rows(ds.catalog(TRAIN)))
    real, fills = torchvision.io.decode_jpeg, []

    def failing(message):
        def decode(blobs, **kwargs):
            fills.append(deterministic.fill_uninitialized_memory)
            if message:
                raise RuntimeError(f"Error while decoding JPEG images: {message}")
            return real(blobs, **kwargs)

        return decode

    monkeypatch.setattr(torchvision.io, "decode_jpeg", failing("NVJPEG_STATUS_ALLOCATOR_FAILURE"))
    with pytest.raises(RuntimeError, match="ALLOCATOR_FAILURE"):
        decoder.batch(prepared, 0, 4)
    assert decoder.clock.get(M.DATA_FALLBACK + "refused") == 0
    monkeypatch.setattr(torchvision.io, "decode_jpeg", failing("NVJPEG_STATUS_BAD_JPEG"))
    decoder.batch(prepared, 0, 4)  # each file refused alone: the PIL path takes all four
    assert decoder.clock.get(M.DATA_FALLBACK + "refused") == 4
    monkeypatch.setattr(torchvision.io, "decode_jpeg", failing(""))
    deterministic.fill_uninitialized_memory = True
    decoder.batch(prepared, 0, 4)
    assert fills[-1] is False and deterministic.fill_uninitialized_memory is True
