"""What ImageFolderDataset reads and how it decodes it (no Ray): exact file names (never
glob-expanded), 16-bit and other PIL modes, EXIF orientation, files that are not images (a
DataError naming the file), hidden files and nested folders; and how a DataError is found
behind the wrappers it reaches a worker in."""

from __future__ import annotations

import io
import struct
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from ftjob.data.datasets import TRAIN, VAL, DataError, ImageFolderDataset, data_error_of

GLOB_NAMES = ("photo[1].png", "photo1.png", "a*.png", "ab.png", "b?.png", "bc.png")


def png(pixels: np.ndarray, **save: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", **save)
    return out.getvalue()


def solid(value: int, size: int = 12) -> bytes:
    return png(np.full((size, size, 3), value, dtype=np.uint8))


def png16(values: np.ndarray) -> bytes:
    """A 16-bit PNG (grey, grey+alpha, RGB or RGBA by the channel count), written by hand: PIL
    writes only 16-bit grey."""
    h, w = values.shape[:2]
    channels = 1 if values.ndim == 2 else values.shape[2]
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    raw = b"".join(b"\0" + values[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def rows(ds: ImageFolderDataset, split: str) -> dict[str, np.ndarray]:
    table = ds.catalog(split)
    return {n: table.column(n).to_numpy(zero_copy_only=False) for n in table.column_names}


def by_name(ds: ImageFolderDataset, split: str, images: np.ndarray) -> dict[str, np.ndarray]:
    return {
        str(p).rsplit("/", 1)[1]: img
        for p, img in zip(rows(ds, split)["path"], images, strict=True)
    }


def write_tree(fs: Any, root: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{rel}", data)


def glob_tree() -> dict[str, bytes]:
    """Each file a solid grey of its own: a file read in another's place shows."""
    files = {}
    for split in (TRAIN, VAL):
        for k, name in enumerate(GLOB_NAMES):
            files[f"{split}/c/{name}"] = solid(20 + 30 * k)
        files[f"{split}/d/plain.png"] = solid(250)
    return files


def check_glob_tree(ds: ImageFolderDataset) -> None:
    for split in (TRAIN, VAL):
        names = [str(p).rsplit("/", 1)[1] for p in rows(ds, split)["path"]]
        assert sorted(names) == sorted([*GLOB_NAMES, "plain.png"])  # listed as they are
        decoded = by_name(ds, split, ds.decode(rows(ds, split), split, epoch=0, seed=0))
        for k, name in enumerate(GLOB_NAMES):
            assert (decoded[name] == 20 + 30 * k).all(), name  # that file's pixels
        # a batch of one glob-like name alone reads that file only
        i = names.index("photo[1].png")
        alone = {n: v[i : i + 1] for n, v in rows(ds, split).items()}
        assert (ds.decode(alone, split, epoch=0, seed=0) == 20).all()


def test_file_names_with_glob_characters_are_read_exactly_on_local_disk(tmp_path: Path):
    write_tree(fsspec.filesystem("file"), str(tmp_path), glob_tree())
    check_glob_tree(ImageFolderDataset(path=str(tmp_path), image_size=8, resize_size=8))


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"/ftjob-test-{uuid.uuid4().hex[:8]}"
    yield root
    fsspec.filesystem("memory").rm(root, recursive=True)


def test_file_names_with_glob_characters_are_read_exactly_in_memory(memory_root: str):
    write_tree(fsspec.filesystem("memory"), memory_root, glob_tree())
    check_glob_tree(ImageFolderDataset(path=f"memory://{memory_root}", image_size=8, resize_size=8))


@pytest.mark.s3
def test_file_names_with_glob_characters_are_read_exactly_on_s3(s3_endpoint: str, s3_bucket: str):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # instances cache listings per option set
    try:
        fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
        broken = {"train/c/1.png": solid(1), "train/c/page.png": b"<html>503 Slow Down</html>"}
        for tree, files in (("tree", glob_tree()), ("broken", broken)):
            for rel, data in files.items():
                fs.pipe_file(f"{s3_bucket}/{tree}/{rel}", data)
        options = {"storage_options": {"endpoint_url": s3_endpoint}}
        url = f"s3://{s3_bucket}/tree"
        check_glob_tree(ImageFolderDataset(path=url, image_size=8, resize_size=8, **options))
        ds = ImageFolderDataset(path=f"s3://{s3_bucket}/broken", image_size=8, **options)
        with pytest.raises(DataError) as err:
            ds.decode(rows(ds, TRAIN), TRAIN, epoch=0, seed=0)
        assert str(err.value).startswith(
            f"dataset file s3://{s3_bucket}/broken/train/c/page.png cannot be decoded as an "
            "image (UnidentifiedImageError"
        )
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


# -- modes ------------------------------------------------------------------------------------


def decode_one(tmp_path: Path, data: bytes, name: str = "x.png", size: int = 16) -> np.ndarray:
    """The validation decode (HWC) of one file at ``size`` px, resized to it (no crop)."""
    folder = tmp_path / "val" / "c"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    ds = ImageFolderDataset(path=str(tmp_path), image_size=size, resize_size=size)
    table = pa.table({"id": [0], "label": [0], "path": [str(folder / name)]})
    batch = {n: table.column(n).to_numpy(zero_copy_only=False) for n in table.column_names}
    return ds.decode(batch, VAL, epoch=0, seed=0)[0].transpose(1, 2, 0)


GRADIENT16 = (np.arange(16)[None, :] * 4369 + np.arange(16)[:, None] * 0).astype(np.uint16)


def test_a_16_bit_grey_png_decodes_to_its_8_bit_gradient_not_white(tmp_path: Path):
    data = png(GRADIENT16)
    with Image.open(io.BytesIO(data)) as img:
        assert img.mode == "I;16"
    out = decode_one(tmp_path, data)
    expected = (GRADIENT16 >> 8).astype(np.uint8)  # 0, 17, 34, ... 255 across
    assert np.array_equal(out, np.repeat(expected[..., None], 3, axis=2))


@pytest.mark.parametrize("channels", [2, 3, 4])
def test_16_bit_colour_pngs_decode_to_their_high_bytes(tmp_path: Path, channels: int):
    values = np.stack([GRADIENT16, GRADIENT16[::-1], GRADIENT16.T, np.full_like(GRADIENT16, 65535)])
    out = decode_one(tmp_path, png16(np.moveaxis(values[:channels], 0, -1)))
    high = (values >> 8).astype(np.uint8)
    expected = np.repeat(high[0][..., None], 3, 2) if channels == 2 else high[:3].transpose(1, 2, 0)
    assert np.array_equal(out, expected)


def test_32_bit_integer_tiffs_with_16_bit_or_8_bit_values_are_scaled_by_their_range(
    tmp_path: Path,
):
    for name, values, expected in (
        ("wide.tif", GRADIENT16.astype(np.int32), GRADIENT16 >> 8),
        ("narrow.tif", (GRADIENT16 >> 8).astype(np.int32), GRADIENT16 >> 8),
    ):
        data = io.BytesIO()
        Image.fromarray(values).save(data, format="TIFF")
        with Image.open(io.BytesIO(data.getvalue())) as img:
            assert img.mode == "I"
        out = decode_one(tmp_path, data.getvalue(), name)
        assert np.array_equal(out[..., 0], expected.astype(np.uint8)), name


@pytest.mark.parametrize("mode", ["P", "L", "LA", "RGBA", "CMYK", "1"])
def test_other_modes_convert_as_pil_does(tmp_path: Path, mode: str):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).convert(mode)
    data = io.BytesIO()
    img.save(data, format="TIFF" if mode == "CMYK" else "PNG")
    out = decode_one(tmp_path, data.getvalue(), f"x.{'tif' if mode == 'CMYK' else 'png'}")
    with Image.open(io.BytesIO(data.getvalue())) as again:
        assert np.array_equal(out, np.asarray(again.convert("RGB")))


# -- EXIF orientation ---------------------------------------------------------------------------

# The transposition that stores an upright picture under each EXIF orientation (the inverse
# of the one that shows it).
STORED_AS = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def upright_picture(width: int, height: int) -> Image.Image:
    yy, xx = np.mgrid[0:height, 0:width]
    red = xx * 255 // max(1, width - 1)
    green = yy * 255 // max(1, height - 1)
    return Image.fromarray(np.stack([red, green, 255 - red], -1).astype(np.uint8))


def save_jpeg(path: Path, img: Image.Image, orientation: int | None = None) -> None:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    img.save(path, format="JPEG", quality=95, exif=exif)


@pytest.mark.parametrize("orientation", sorted(STORED_AS))
@pytest.mark.parametrize("width, height, size", [(40, 20, 16), (800, 400, 32)])
def test_jpegs_are_turned_upright_by_their_exif_orientation_before_the_crop(
    tmp_path: Path, orientation: int, width: int, height: int, size: int
):
    """The 800 px picture decodes in draft mode (1/8 for validation, a random crop's own
    scale for training): drafted first, then turned, the crop box fitted to the turned size."""
    picture = upright_picture(width, height)
    for split in (TRAIN, VAL):
        folder = tmp_path / split / "c"
        folder.mkdir(parents=True)
        save_jpeg(folder / "a_upright.jpg", picture)
        save_jpeg(folder / "b_turned.jpg", picture.transpose(STORED_AS[orientation]), orientation)
    ds = ImageFolderDataset(path=str(tmp_path), image_size=size, resize_size=size + 4)
    for split in (TRAIN, VAL):
        batch = rows(ds, split)
        # both with the upright one's id: the same random crop and flip in training
        same = {**{n: v[[0, 0]] for n, v in batch.items()}, "path": batch["path"]}
        for epoch in range(3):
            upright, turned = ds.decode(same, split, epoch=epoch, seed=0).astype(int)
            assert np.abs(upright - turned).mean() < 4, (split, epoch)
            assert np.abs(upright - turned).max() < 48, (split, epoch)


def test_an_image_without_orientation_decodes_as_before(tmp_path: Path):
    picture = upright_picture(40, 20)
    out = decode_one(tmp_path, png(np.asarray(picture)), size=20)
    expected = np.asarray(picture.resize((40, 20), Image.BILINEAR))[:, 10:30]
    assert np.array_equal(out, expected)


# -- files that are not images, hidden files, nested folders ------------------------------------


def tree_of(tmp_path: Path, files: dict[str, bytes]) -> ImageFolderDataset:
    write_tree(fsspec.filesystem("file"), str(tmp_path), files)
    return ImageFolderDataset(path=str(tmp_path), image_size=8, resize_size=8)


GOOD = {
    f"{split}/{c}/{i}.png": solid(100 + i) for split in (TRAIN, VAL) for c in "ab" for i in (1, 2)
}


@pytest.mark.parametrize(
    "name, data, reason",
    [
        ("garbage.jpg", b"\x00garbage, not a JPEG" * 10, "UnidentifiedImageError"),
        ("page.png", b"<html><body>403 Forbidden</body></html>", "UnidentifiedImageError"),
        ("truncated.png", solid(7, size=64)[:60], "OSError"),
        ("truncated.jpg", None, "OSError"),
    ],
    ids=["garbage", "html", "truncated-png", "truncated-jpeg"],
)
def test_a_file_that_is_not_an_image_is_refused_naming_it_on_every_attempt(
    tmp_path: Path, name: str, data: bytes | None, reason: str
):
    if data is None:
        jpeg = io.BytesIO()
        upright_picture(64, 64).save(jpeg, format="JPEG")
        data = jpeg.getvalue()[:400]
    ds = tree_of(tmp_path, {**GOOD, f"train/a/{name}": data})
    batch = rows(ds, TRAIN)
    path = tmp_path / "train" / "a" / name
    assert str(path) in batch["path"].tolist()
    messages = []
    for epoch in (0, 1):  # the same file fails again: deterministic
        with pytest.raises(DataError) as err:
            ds.decode(batch, TRAIN, epoch=epoch, seed=0)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"dataset file {path} cannot be decoded as an image ({reason}")
    assert messages[0].endswith("or set dataset.bad_files=skip") and "\n" not in messages[0]
    assert "BytesIO" not in messages[0]
    assert data_error_of(err.value) is err.value


def test_a_file_gone_since_the_listing_is_a_data_error_naming_it(tmp_path: Path):
    ds = tree_of(tmp_path, GOOD)
    batch = rows(ds, VAL)
    (tmp_path / "val" / "b" / "2.png").unlink()
    with pytest.raises(DataError, match=rf"dataset file {tmp_path}/val/b/2.png cannot be read"):
        ds.decode(batch, VAL, epoch=0, seed=0)


def test_hidden_and_appledouble_files_are_not_samples_and_are_said_in_one_line(tmp_path: Path):
    garbage = b"\x00\x05\x16\x07AppleDouble metadata"
    ds = tree_of(
        tmp_path,
        {
            **GOOD,
            "train/a/._1.png": garbage,
            "train/b/._2.png": garbage,
            "train/b/.hidden.png": garbage,
            "train/b/.thumbs/3.png": garbage,
            "train/.cache/4.png": garbage,  # a hidden folder is not a class
            "train/b/.DS_Store": b"\x00\x00\x00\x01Bud1",
            "val/a/._1.png": garbage,
        },
    )
    assert ds.classes == ["a", "b"]
    for split in (TRAIN, VAL):
        paths = rows(ds, split)["path"].tolist()
        assert len(paths) == 4 and not any("/." in p for p in paths)
        ds.decode(rows(ds, split), split, epoch=0, seed=0)  # nothing left that fails
    train_note, val_note = ds.catalog_notes()
    assert train_note == (
        f"dataset.path={tmp_path}: skipped 5 hidden/AppleDouble file(s) under train/ (e.g. "
        "train/.cache/4.png): a name starting with '.' is not a sample"
    )
    assert "skipped 1 hidden/AppleDouble file(s) under val/ (e.g. val/a/._1.png)" in val_note


def test_images_in_nested_folders_belong_to_their_top_class_folder(tmp_path: Path):
    ds = tree_of(
        tmp_path,
        {
            **GOOD,
            "train/a/2019/summer/5.png": solid(5),
            "train/b/raw/6.png": solid(6),
            "train/c/only/nested/7.png": solid(7),  # a class folder with nested images only
            "val/c/8.png": solid(8),
            "train/loose.png": solid(9),
            "train/notes.txt": b"not an image",
        },
    )
    assert ds.classes == ["a", "b", "c"]
    train = rows(ds, TRAIN)
    labels = dict(
        zip([str(p)[len(str(tmp_path)) + 1 :] for p in train["path"]], train["label"], strict=True)
    )
    assert labels == {
        "train/a/1.png": 0,
        "train/a/2.png": 0,
        "train/a/2019/summer/5.png": 0,
        "train/b/1.png": 1,
        "train/b/2.png": 1,
        "train/b/raw/6.png": 1,
        "train/c/only/nested/7.png": 2,
    }
    assert train["id"].tolist() == list(range(7))
    decoded = ds.decode(train, TRAIN, epoch=0, seed=0)
    assert (decoded[2] == 5).all() and (decoded[6] == 7).all()
    assert ds.catalog_notes() == [
        f"dataset.path={tmp_path}: 1 file(s) under train/ are not named as images (e.g. "
        "train/notes.txt): not samples; a sample's name ends in .jpg, .jpeg, .png, .bmp, "
        ".webp, .gif, .tif, .tiff",
        f"dataset.path={tmp_path}: 1 image file(s) directly in train/ (e.g. train/loose.png) "
        "are not samples: a sample is under train/<class>/",
    ]


def test_a_flat_tree_has_no_notes_and_the_same_catalog_as_before(tmp_path: Path):
    from tests.support.images import make_image_tree

    ds = ImageFolderDataset(path=str(make_image_tree(tmp_path, classes=2, train_per_class=3)))
    train = ds.catalog(TRAIN)
    assert ds.catalog_notes() == []
    expected = [
        str(tmp_path / "train" / f"class_{c}" / f"{i:03d}.png") for c in (0, 1) for i in range(3)
    ]
    assert train.column("path").to_pylist() == expected
    assert train.column("label").to_pylist() == [0, 0, 0, 1, 1, 1]


# -- finding a DataError behind its wrappers ---------------------------------------------------


def raised(make: Any) -> BaseException:
    try:
        make()
    except BaseException as exc:
        return exc
    raise AssertionError("nothing raised")


def data_error() -> DataError:
    return DataError("dataset file s3://b/train/cat/x.jpg cannot be decoded as an image (...)")


def test_a_data_error_is_found_behind_ray_datas_and_ray_cores_wrappers():
    import traceback

    from ray.data.exceptions import UserCodeException
    from ray.exceptions import RayError, RayTaskError

    def user_code() -> None:
        try:
            raise data_error()
        except DataError as exc:
            raise UserCodeException("UDF failed to process a data block.") from exc

    wrapped = raised(user_code)
    assert str(data_error_of(wrapped)) == str(data_error())
    task_error = RayTaskError(
        "map_batches", "".join(traceback.format_exception(wrapped)), wrapped, "p", 1, "1.2.3.4"
    )
    # Through the object store: the pickled UserCodeException keeps no __cause__, only the
    # task's traceback has the DataError's line.
    arrived = RayError.from_bytes(task_error.to_bytes())
    assert arrived.cause.__cause__ is None
    for exc in (arrived, arrived.as_instanceof_cause()):
        found = data_error_of(exc)
        assert isinstance(found, DataError) and str(found) == str(data_error())
    # DataContext.raise_original_map_exception: the DataError is the task error's cause
    direct = RayTaskError("map_batches", "tb", data_error(), "p", 1, "1.2.3.4")
    dual = RayError.from_bytes(direct.to_bytes()).as_instanceof_cause()
    assert isinstance(dual, DataError) and str(data_error_of(dual)) == str(data_error())
    other = RayTaskError("map_batches", "ValueError: bad", ValueError("bad"), "p", 1, "1.2.3.4")
    assert data_error_of(other) is None and data_error_of(RuntimeError("x")) is None


def test_a_data_error_of_the_first_window_and_the_feeder_reaches_the_training_thread(
    tmp_path: Path,
):
    from ftjob.data.streams import BatchFeeder, LocalWindow, _Decode

    ds = tree_of(tmp_path, {**GOOD, "train/b/3.png": b"not a png"})
    table = ds.catalog(TRAIN)
    decode = _Decode(ds, TRAIN, epoch=0, seed=0)
    exc = raised(lambda: LocalWindow.decode([table], decode))
    assert isinstance(data_error_of(exc), DataError)
    assert f"{tmp_path}/train/b/3.png" in str(data_error_of(exc))

    class Stream:
        def epoch(self, epoch: int, position: int) -> Iterator[Any]:
            yield "first"
            LocalWindow.decode([table], decode)
            yield "never"

    stream = Stream()
    feeder = BatchFeeder(stream, stream.epoch(0, 0), 0, 1, 1, first_steps=2, steps_per_epoch=2)
    try:
        exc = raised(lambda: list(feeder))
    finally:
        feeder.close()
    assert isinstance(data_error_of(exc), DataError)


# -- dataset.bad_files, dataset.max_image_pixels ------------------------------------------------


def test_with_bad_files_skip_a_file_that_does_not_decode_is_skipped_the_same_in_every_epoch(
    tmp_path: Path,
):
    ds = tree_of(
        tmp_path, {**GOOD, "train/a/empty.jpg": b"", "train/b/3.png": solid(7, size=64)[:60]}
    )
    batch = rows(ds, TRAIN)
    skip = ImageFolderDataset(path=str(tmp_path), image_size=8, resize_size=8, bad_files="skip")
    names = [p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p in batch["path"]]
    bad = [n in ("a/empty.jpg", "b/3.png") for n in names]
    for epoch in (0, 1):
        images, skipped = skip.decode_batch(batch, TRAIN, epoch=epoch, seed=0)
        assert skipped.tolist() == bad
        assert not images[skipped].any() and all(img.any() for img in images[~skipped])
    with pytest.raises(DataError, match="a/empty.jpg cannot be decoded"):
        ds.decode_batch(batch, TRAIN, epoch=0, seed=0)  # bad_files=fail, the default
    assert skip.check_file(str(tmp_path / "train" / "b" / "3.png")) == (
        "OSError: image file is truncated"
    )
    assert skip.check_file(str(tmp_path / "train" / "a" / "1.png")) is None


def test_max_image_pixels_is_the_limit_in_every_process_not_pils_global_one(tmp_path: Path):
    ds = tree_of(tmp_path, {**GOOD, "val/a/big.png": png(np.zeros((120, 100, 3), np.uint8))})
    batch = rows(ds, VAL)
    strict = ImageFolderDataset(
        path=str(tmp_path), image_size=8, resize_size=8, max_image_pixels=11999
    )
    with pytest.raises(DataError) as err:
        strict.decode(batch, VAL, epoch=0, seed=0)
    assert (
        "big.png cannot be decoded as an image (ImageTooLarge: 100x120 = 12000 pixels, more "
        in (str(err.value))
    )
    assert "dataset.max_image_pixels=11999" in str(err.value)
    # PIL's process-wide limit is not what decides: a process where it is lower decodes
    # what the dataset allows.
    Image.MAX_IMAGE_PIXELS = 100
    try:
        for allowed in (12000, None):
            ok = ImageFolderDataset(
                path=str(tmp_path), image_size=8, resize_size=8, max_image_pixels=allowed
            )
            assert ok.decode(batch, VAL, epoch=0, seed=0).shape == (5, 3, 8, 8)
    finally:
        Image.MAX_IMAGE_PIXELS = None


# -- the tree's audit: classes that are not what they look like; links out of the root ---------


def test_a_class_folder_without_images_is_refused_by_name(tmp_path: Path):
    ds = tree_of(tmp_path, {**GOOD, "train/c/notes.txt": b"no images here", "train/.cache/x": b""})
    (tmp_path / "train" / "d").mkdir()
    with pytest.raises(ValueError) as err:
        ds.catalog(TRAIN)
    assert "class folder(s) without images under train/: c, d;" in str(err.value)
    assert ".cache" not in str(err.value)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"val/c/1.png": solid(1)}, "not in train/: c"),
        ({"train/c/1.png": solid(1)}, "missing from val/: c"),
    ],
)
def test_a_validation_split_with_other_classes_is_refused_naming_them(
    tmp_path: Path, extra: dict[str, bytes], named: str
):
    ds = tree_of(tmp_path, {**GOOD, **extra})
    with pytest.raises(ValueError) as err:
        ds.catalog(VAL)
    assert "the class folders of val/ differ from train/'s (" + named in str(err.value)


def test_a_class_count_other_than_num_classes_is_refused_naming_the_folders(tmp_path: Path):
    from ftjob.config import ConfigError

    write_tree(fsspec.filesystem("file"), str(tmp_path), GOOD)
    ds = ImageFolderDataset(path=str(tmp_path), image_size=8, resize_size=8, num_classes=3)
    with pytest.raises(ConfigError) as err:
        ds.catalog(TRAIN)
    assert err.value.key == "dataset.num_classes" and err.value.value == 3
    assert "has 2 class folders under train/ (a, b)" in err.value.rule


def test_links_to_outside_the_dataset_are_not_samples(tmp_path: Path):
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "secret.png").write_bytes(solid(9))
    root = tmp_path / "data"
    ds = tree_of(root, GOOD)
    (root / "train" / "a" / "link.png").symlink_to(outside / "secret.png")
    # A folder that is a link is followed: its files are judged as links are, by where they lie.
    (root / "train" / "b" / "elsewhere").symlink_to(outside, target_is_directory=True)
    (root / "train" / "b" / "same.png").symlink_to(root / "train" / "a" / "1.png")
    ds = ImageFolderDataset(path=str(root), image_size=8, resize_size=8)
    paths = ds.catalog(TRAIN).column("path").to_pylist()
    assert not any("link.png" in p or "elsewhere" in p for p in paths)
    assert str(root / "train" / "b" / "same.png") in paths  # a link inside the root is fine
    [note] = [n for n in ds.catalog_notes() if "links to outside" in n]
    assert "skipped 2 file(s) under train/ that are links to outside dataset.path" in note
    assert "(e.g. train/a/link.png)" in note


def test_a_tree_of_links_into_an_image_pool_is_refused_with_the_key_or_read_when_asked(
    tmp_path: Path,
):
    pool, root = tmp_path / "pool", tmp_path / "data"
    pool.mkdir()
    for split in ("train", "val"):
        for label, value in (("a", 10), ("b", 200)):
            (root / split / label).mkdir(parents=True)
            for i in range(2):
                image = pool / f"{split}-{label}-{i}.png"
                image.write_bytes(solid(value + i))
                (root / split / label / f"{i}.png").symlink_to(image)
    confined = ImageFolderDataset(path=str(root), image_size=8, resize_size=8)
    with pytest.raises(ValueError, match="are all links to outside dataset.path") as err:
        confined.catalog(TRAIN)
    assert "dataset.follow_links=true" in str(err.value) and "without images" not in str(err.value)
    linked = ImageFolderDataset(path=str(root), image_size=8, resize_size=8, follow_links=True)
    assert linked.catalog(TRAIN).num_rows == 4 and linked.num_classes == 2
