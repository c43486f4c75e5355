"""How a class-per-folder tree is listed (ftjob/data/folders.py): links are followed to where
they lead at every level -- a class folder kept on another disk is never a class dropped without
a word -- and read when they stay inside the dataset's root or ``dataset.follow_links`` allows
it; a tree that could only train on less than it holds (one class, a class folder that leads
nowhere) is refused by name before anything trains. Real files on local disk; no Ray."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ftjob.data.datasets import TRAIN, VAL, ImageFolderDataset

CLASSES = ("a", "b", "c")


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def write_class(folder: Path, value: int, count: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i}.png").write_bytes(png(value + i))


def tree(root: Path, classes: tuple[str, ...] = CLASSES) -> Path:
    for split in (TRAIN, VAL):
        for k, name in enumerate(classes):
            write_class(root / split / name, 40 * k + 10)
    return root


def dataset(root: Path, **kwargs: object) -> ImageFolderDataset:
    return ImageFolderDataset(path=str(root), image_size=8, resize_size=8, **kwargs)


def labels_by_class(ds: ImageFolderDataset, split: str) -> dict[str, int]:
    table = ds.catalog(split)
    out: dict[str, int] = {}
    for path in table.column("path").to_pylist():
        name = path.split(f"/{split}/", 1)[1].split("/")[0]
        out[name] = out.get(name, 0) + 1
    return out


def move_class_out(root: Path, elsewhere: Path, name: str) -> None:
    """One class of each split kept on another disk, linked in at the class level."""
    for split in (TRAIN, VAL):
        target = elsewhere / split / name
        target.parent.mkdir(parents=True, exist_ok=True)
        (root / split / name).rename(target)
        (root / split / name).symlink_to(target, target_is_directory=True)


def test_a_class_folder_linked_to_another_disk_is_refused_naming_it_or_read_when_asked(
    tmp_path: Path,
):
    root = tree(tmp_path / "imagenet")
    move_class_out(root, tmp_path / "disk2", "c")
    with pytest.raises(ValueError) as err:
        dataset(root).catalog(TRAIN)
    said = str(err.value)
    assert "class folder(s) under train/ are links to outside dataset.path: c -> " in said
    assert str(tmp_path / "disk2" / "train" / "c") in said and "dataset.follow_links=true" in said
    linked = dataset(root, follow_links=True)
    assert labels_by_class(linked, TRAIN) == {"a": 2, "b": 2, "c": 2}
    assert linked.num_classes == 3 and linked.catalog(VAL).num_rows == 6
    table = linked.catalog(VAL)
    rows = {n: table.column(n).to_numpy(zero_copy_only=False) for n in table.column_names}
    images = linked.decode(rows, VAL, epoch=0, seed=0)
    assert images.shape == (6, 3, 8, 8) and images[-1].any()  # class c's images were read
    assert any("class folder(s) under train/ are links" in n for n in linked.catalog_notes())


def test_a_class_folder_linked_inside_the_root_is_a_class_as_imagefolder_reads_it(
    tmp_path: Path,
):
    root = tree(tmp_path / "data")
    move_class_out(root, root / "shared", "c")  # still under dataset.path
    ds = dataset(root)
    assert labels_by_class(ds, TRAIN) == {"a": 2, "b": 2, "c": 2} and ds.num_classes == 3
    [note] = [n for n in ds.catalog_notes() if "are links" in n and "train/" in n]
    assert f"1 class folder(s) under train/ are links, read where they lead (e.g. c -> {root}" in (
        note
    )


def test_a_class_folder_link_that_leads_nowhere_is_refused_naming_it(tmp_path: Path):
    root = tree(tmp_path / "data")
    (root / TRAIN / "d").symlink_to(tmp_path / "unmounted" / "d", target_is_directory=True)
    with pytest.raises(ValueError) as err:
        dataset(root, follow_links=True).catalog(TRAIN)
    assert "class folder link(s) under train/ lead to nothing: d -> " in str(err.value)


def test_a_linked_class_folder_without_images_is_refused_as_an_empty_one(tmp_path: Path):
    root = tree(tmp_path / "data")
    (root / "spare").mkdir()
    (root / TRAIN / "d").symlink_to(root / "spare", target_is_directory=True)
    with pytest.raises(ValueError, match="class folder.s. without images under train/: d;"):
        dataset(root).catalog(TRAIN)


def test_a_link_back_up_the_tree_is_walked_once(tmp_path: Path):
    root = tree(tmp_path / "data")
    (root / TRAIN / "a" / "again").symlink_to(root / TRAIN, target_is_directory=True)
    ds = dataset(root)
    assert labels_by_class(ds, TRAIN) == {"a": 2, "b": 2, "c": 2}


def test_files_not_named_as_images_are_said_in_one_line(tmp_path: Path):
    root = tree(tmp_path / "data")
    (root / TRAIN / "a" / "photo.heic").write_bytes(b"x")
    (root / TRAIN / "b" / "notes.txt").write_bytes(b"x")
    (root / TRAIN / "b" / ".DS_Store").write_bytes(b"x")  # hidden: not worth a word
    ds = dataset(root)
    assert labels_by_class(ds, TRAIN) == {"a": 2, "b": 2, "c": 2}
    [note] = [n for n in ds.catalog_notes() if "not named as images" in n]
    assert "2 file(s) under train/ are not named as images (e.g. train/a/photo.heic)" in note
    assert ".jpg, .jpeg, .png" in note
