"""Listing a class-per-folder image tree (``{root}/{class}/.../*.jpg``) and auditing it before
anything trains: which files are samples, which are not and why, and whether the classes are
what they look like. Used by :class:`ftjob.data.datasets.ImageFolderDataset` on the driver.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


@dataclass
class SplitListing:
    """One split's samples by class folder (sorted paths), and one-line notes on the files
    under it that are not samples."""

    by_class: dict[str, list[str]]
    notes: list[str] = field(default_factory=list)


def is_local(fs: Any) -> bool:
    protocol = fs.protocol
    return protocol in ("file", "local") or (
        isinstance(protocol, tuple) and protocol[0] in ("file", "local")
    )


def names(items: list[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def inside(fs: Any, base: str, follow_links: bool = False) -> Callable[[str], bool]:
    """Whether a listed file stays inside ``base`` once its links are followed (local disk;
    object stores have no links: every listed key is inside). A path from the user never
    reaches outside the root it names, unless ``dataset.follow_links`` says it may."""
    if follow_links or not is_local(fs):
        return lambda path: True
    real_root = os.path.realpath(base).rstrip(os.sep) + os.sep
    return lambda path: os.path.realpath(path).startswith(real_root)


def list_files(fs: Any, root: str) -> list[str]:
    """Every file under ``root``. On local disk links to folders are followed at any depth, as
    torchvision's ImageFolder follows them (``os.walk(followlinks=True)``): fsspec's ``find``
    lists such a link as one entry that is not a folder, so a class folder that is a link --
    one class of a tree kept on another disk -- would be dropped without a word. A link back
    up the tree (a loop) is not walked again; object stores have no links."""
    if not is_local(fs):
        try:
            return list(fs.find(root))
        except FileNotFoundError:
            return []
    out: list[str] = []
    todo = [(root, frozenset({os.path.realpath(root)}))]
    while todo:
        folder, above = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            full = posixpath.join(folder, entry.name)
            if not entry.is_dir():  # a file, a link to one, or a link to nothing
                out.append(full)
                continue
            real = os.path.realpath(full)
            if real not in above:
                todo.append((full, above | {real}))
    return out


def list_split(
    fs: Any, root: str, folder: str, path: str, base: str, follow_links: bool = False
) -> SplitListing:
    """The samples under ``root`` (the split folder ``folder`` of the dataset at ``path``,
    whose root on ``fs`` is ``base``): every image file at any depth under a class folder, as
    torchvision's ImageFolder -- except hidden files (a name starting with ``.``: macOS's
    AppleDouble ``._x.jpg``...), files directly in the split folder, and files whose links
    lead outside the dataset, each said in a note. Links are followed to where they lead, at
    any level (a class folder, a file): what lies inside the dataset's root is read; what lies
    outside only with ``follow_links`` -- a class folder that leads outside, or to nothing, is
    refused by name. A class folder without images is refused by name."""
    linked = check_linked_folders(fs, root, folder, path, base, follow_links)
    files = list_files(fs, root)
    by_class: dict[str, list[str]] = {}
    hidden: list[str] = []
    loose: list[str] = []
    outside: list[str] = []
    other: list[str] = []  # not hidden, not named as an image: said, in case they are ones
    within = inside(fs, base, follow_links)
    for f in sorted(files):
        parts = posixpath.relpath(f, root).split("/")
        if not parts[-1].lower().endswith(IMAGE_EXTENSIONS):
            if not any(part.startswith(".") for part in parts):
                other.append(posixpath.join(folder, *parts))
            continue
        if any(part.startswith(".") for part in parts):
            hidden.append(posixpath.join(folder, *parts))
        elif len(parts) == 1:
            loose.append(posixpath.join(folder, *parts))
        elif not within(f):
            outside.append(posixpath.join(folder, *parts))
        else:
            by_class.setdefault(parts[0], []).append(f)
    linked_out = {posixpath.relpath(p, folder).split("/")[0] for p in outside}
    check_class_folders(fs, root, folder, path, by_class, linked_out)
    notes = listing_notes(path, folder, linked, hidden, outside, other, loose)
    return SplitListing(by_class, notes)


def listing_notes(
    path: str,
    folder: str,
    linked: list[str],
    hidden: list[str],
    outside: list[str],
    other: list[str],
    loose: list[str],
) -> list[str]:
    """One line for each kind of file under ``folder`` that is not a sample (and for the class
    folders that are links, read where they lead): how many, and an example."""
    notes = []
    if linked:
        notes.append(
            f"dataset.path={path}: {len(linked)} class folder(s) under {folder}/ are links, "
            f"read where they lead (e.g. {linked[0]})"
        )
    if hidden:
        notes.append(
            f"dataset.path={path}: skipped {len(hidden)} hidden/AppleDouble file(s) "
            f"under {folder}/ (e.g. {hidden[0]}): a name starting with '.' is not a sample"
        )
    if outside:
        notes.append(
            f"dataset.path={path}: skipped {len(outside)} file(s) under {folder}/ that are "
            f"links to outside dataset.path (e.g. {outside[0]}): nothing is read from outside "
            "the dataset's root unless dataset.follow_links=true"
        )
    if other:
        notes.append(
            f"dataset.path={path}: {len(other)} file(s) under {folder}/ are not named as images "
            f"(e.g. {other[0]}): not samples; a sample's name ends in "
            f"{', '.join(IMAGE_EXTENSIONS)}"
        )
    if loose:
        notes.append(
            f"dataset.path={path}: {len(loose)} image file(s) directly in {folder}/ "
            f"(e.g. {loose[0]}) are not samples: a sample is under {folder}/<class>/"
        )
    return notes


def check_linked_folders(
    fs: Any, root: str, folder: str, path: str, base: str, follow_links: bool
) -> list[str]:
    """The class folders under ``root`` that are links (local disk), as ``name -> target``;
    refused by name: links that lead nowhere (a disk not mounted: the class would vanish),
    and, unless ``follow_links``, links that lead outside the dataset's root ``base`` -- the
    rule a file that is a link to outside follows, at the class level."""
    if not is_local(fs):
        return []
    try:
        entries = [e for e in os.scandir(root) if e.is_symlink() and not e.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    within = inside(fs, base, follow_links)
    said = {e.name: f"{e.name} -> {os.readlink(e.path)}" for e in entries}
    dangling = sorted(e.name for e in entries if not os.path.exists(e.path))
    if dangling:
        raise ValueError(
            f"dataset.path={path!r}: class folder link(s) under {folder}/ lead to nothing: "
            f"{names([said[n] for n in dangling])}; mount or restore what they lead to, or "
            "remove the links (the class would be missing from the data)"
        )
    folders = sorted(e.name for e in entries if e.is_dir())
    out = [n for n in folders if not within(posixpath.join(root, n, "x"))]
    if out:
        raise ValueError(
            f"dataset.path={path!r}: class folder(s) under {folder}/ are links to outside "
            f"dataset.path: {names([said[n] for n in out])}; nothing is read from outside the "
            "dataset's root unless dataset.follow_links=true: set it to read them where they "
            "lead, or copy them in"
        )
    return [said[n] for n in folders]


def check_class_folders(
    fs: Any,
    root: str,
    folder: str,
    path: str,
    by_class: dict[str, list[str]],
    linked_out: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Every class folder holds images: an empty one would be a class with no samples that
    shifts the label space (torchvision's ImageFolder refuses it too). One whose images are
    all links to outside the dataset (``linked_out``) is said as such."""
    folders = class_folder_names(fs, root)
    empty = sorted(n for n in folders if not n.startswith(".") and n not in by_class)
    linked = [n for n in empty if n in linked_out]
    if linked:
        raise ValueError(
            f"dataset.path={path!r}: the images of class folder(s) {names(linked)} under "
            f"{folder}/ are all links to outside dataset.path, which are not read: set "
            "dataset.follow_links=true to read them where they lead, or copy them in"
        )
    if empty:
        raise ValueError(
            f"dataset.path={path!r}: class folder(s) without images under {folder}/: "
            f"{names(empty)}; a class needs at least one image "
            f"({', '.join(IMAGE_EXTENSIONS)}): add its images or remove the folder"
        )


def class_folder_names(fs: Any, root: str) -> list[str]:
    """The folders directly under ``root``; on local disk links to folders are folders too
    (fsspec lists them as neither)."""
    try:
        if is_local(fs):
            return [e.name for e in os.scandir(root) if e.is_dir()]
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        posixpath.basename(str(e["name"]).rstrip("/"))
        for e in entries
        if e.get("type") == "directory"
    ]


def check_same_classes(
    path: str, train: list[str], val: list[str], train_dir: str, val_dir: str
) -> None:
    """The validation split has the training split's class folders, no more, no fewer:
    labels are the training split's folders, so any other would be mislabelled or unseen."""
    unknown, absent = sorted(set(val) - set(train)), sorted(set(train) - set(val))
    if not (unknown or absent):
        return
    differ = ([f"not in {train_dir}/: {names(unknown)}"] if unknown else []) + (
        [f"missing from {val_dir}/: {names(absent)}"] if absent else []
    )
    raise ValueError(
        f"dataset.path={path!r}: the class folders of {val_dir}/ differ from {train_dir}/'s "
        f"({'; '.join(differ)}): labels are the training split's class folders, so both "
        "splits need the same ones"
    )
