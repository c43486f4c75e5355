"""Bad data does not strand a run: ``dataset.bad_files=skip`` drops a file that does not decode
from every epoch at its place in the data order (exact-once over the rest, across restarts and
world sizes), and a run resumes after bad files were removed. Whole jobs on real image files
written with PIL, in this process (tests/local_run.py); no Ray."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

from ftjob.data.datasets import GONE, GONE_REASON, TRAIN, ImageFolderDataset
from ftjob.data.order import epoch_order
from ftjob.driver.resume import catalog_fingerprint
from ftjob.driver.started_catalog import remember_catalog, started_catalog
from ftjob.reporting.summary import exactly_once, format_summary
from ftjob.worker.loop import backward_in_micro_batches
from tests.helpers import compose_job
from tests.local_run import run_locally

PER_CLASS = 23  # good training images per class; one bad file each makes 48 = 6 steps of 8


def write_images(root: Path, per_class: int = PER_CLASS, val: int = 4) -> None:
    """Two classes of 8x8 PNGs (dark and light, with noise: a model learns them)."""
    rng = np.random.default_rng(0)
    for split, n in ((TRAIN, per_class), ("val", val)):
        for name, level in (("a", 40), ("b", 200)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = np.clip(level + rng.normal(0, 20, (8, 8, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def truncated_png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()[:60]


def bad_tree(root: Path) -> dict[str, Path]:
    """Good images plus a zero-byte JPEG (class a) and a truncated PNG (class b): the last
    file of their class folders, so catalog ids 23 and 47."""
    write_images(root)
    bad = {"empty": root / TRAIN / "a" / "empty.jpg", "truncated": root / TRAIN / "b" / "trunc.png"}
    bad["empty"].write_bytes(b"")
    bad["truncated"].write_bytes(truncated_png())
    return bad


BAD_IDS = {23, 47}


def job(data: Path, *overrides: str) -> Any:
    return compose_job(
        "+experiment=digits_ft",
        "dataset=imagefolder",
        f"dataset.path={data}",
        "dataset.image_size=8",
        "dataset.resize_size=8",
        "trainer.epochs=2",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.validate_every_n_steps=0",
        "trainer.audit_samples=true",
        *overrides,
    )


@pytest.mark.worker
def test_skipped_files_keep_exact_once_across_a_restart_and_a_resume_after_their_removal(
    tmp_path: Path,
):
    data, storage = tmp_path / "data", tmp_path / "store"
    bad = bad_tree(data)
    common = ("name=shared", f"checkpoint.storage_path={storage}")
    # Two ranks (4 + 4 a step): step 5 fails (restored from 4), step 10 fails past the budget
    # (the newest checkpoint is step 8, in epoch 1).
    first = run_locally(
        job(
            data,
            *common,
            "dataset.bad_files=skip",
            "trainer.batch_size=4",
            "trainer.num_workers=2",
            "chaos.fail_at_steps=[5,10]",
            "failure.max_failures=1",
        ),
        tmp_path / "a",
    )
    s = first.summary
    assert s["status"] == "failed" and "failure.max_failures=1" in s["error"], first.errors
    epoch0 = s["audit"][0]
    # Epoch 0 across the restart: every sample once at its place; the two bad ones seen and
    # skipped, the other 46 trained.
    assert exactly_once(epoch0) and epoch0["unique"] == 48
    assert (epoch0["skipped"], epoch0["trained"]) == (2, 46)
    listed = {f["path"]: f for f in s["data"]["skipped_files"]}
    assert set(listed) == {str(p) for p in bad.values()} and s["data"]["skipped"] == 2
    assert listed[str(bad["empty"])]["reason"].startswith("UnidentifiedImageError")
    assert listed[str(bad["truncated"])]["reason"] == "OSError: image file is truncated"
    assert {f["id"] for f in listed.values()} == BAD_IDS
    said = [line for line in first.lines if line.startswith("data: skipped train file")]
    assert len(said) == 2  # once each for the run, not once per epoch or attempt
    printed = format_summary(s)
    assert "  data: 2 bad file(s) skipped (dataset.bad_files=skip" in printed
    assert f"    {bad['truncated']} (OSError: image file is truncated)" in printed

    # The bad files are removed; the run resumes on one worker (8 a step: the same global
    # batch), with the default dataset.bad_files=fail: the removed files keep their places
    # in the data order and are skipped without being read.
    for path in bad.values():
        path.unlink()
    resumed = run_locally(
        job(data, *common, "resume=true", "trainer.batch_size=8", "trainer.num_workers=1"),
        tmp_path / "b",
    )
    s = resumed.summary
    assert s["status"] == "succeeded", (s["error"], resumed.errors)
    [epoch1] = s["audit"]
    assert epoch1["epoch"] == 1 and epoch1["resumed_at"] == 2 * 8
    assert exactly_once(epoch1) and epoch1["unique"] == 48 - 16
    order = epoch_order(48, 0, 1)[16:]
    met = BAD_IDS & set(order.tolist())
    assert epoch1["skipped"] == len(met) and epoch1["trained"] == 32 - len(met)
    assert {f["id"] for f in s["data"]["skipped_files"]} == met
    assert all(f["reason"] == GONE_REASON for f in s["data"]["skipped_files"])
    stated = [line for line in resumed.prep.notes if "removed since the run started" in line]
    assert len(stated) == 1 and "2 file(s)" in stated[0]
    assert "a/empty.jpg" in stated[0] and "b/trunc.png" in stated[0]
    assert any("dataset.bad_files: 'skip' -> 'fail'" in n for n in resumed.prep.notes)


def catalog_of(root: Path) -> tuple[ImageFolderDataset, pa.Table]:
    ds = ImageFolderDataset(path=str(root), image_size=8, resize_size=8)
    return ds, ds.catalog(TRAIN)


def test_a_removed_file_keeps_its_row_and_the_fingerprint_while_added_files_change_it(
    tmp_path: Path,
):
    data, run_path = tmp_path / "data", str(tmp_path / "run")
    bad = bad_tree(data)
    ds, table = catalog_of(data)
    fs = ds.fs
    remember_catalog(fs, run_path, table)
    before = catalog_fingerprint(table, ds.num_classes)
    bad["empty"].unlink()
    _, now = catalog_of(data)
    assert catalog_fingerprint(now, 2) != before  # listed again, every later id shifts
    assert started_catalog(fs, run_path, now, resume=False) == (now, [])
    kept, stated = started_catalog(fs, run_path, now, resume=True)
    assert catalog_fingerprint(kept, 2) == before
    assert kept.column(GONE).to_pylist() == [i == 23 for i in range(48)]
    assert kept.column("path").to_pylist() == table.column("path").to_pylist()
    assert stated == [
        "train data: 1 file(s) removed since the run started (a/empty.jpg): each keeps its "
        "place in the data order and is skipped, so the order and exact-once hold"
    ]
    # A file added since cannot keep the order: the catalog as listed, for the resume check.
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(data / TRAIN / "b" / "new.png")
    _, grown = catalog_of(data)
    assert started_catalog(fs, run_path, grown, resume=True) == (grown, [])
    # The decode of a gone row reads nothing and skips it, whatever dataset.bad_files says.
    part = kept.slice(20, 4)  # ids 20-23: the last is gone
    rows = {k: np.asarray(part.column(k).to_pylist()) for k in part.column_names}
    images, skipped = ds.decode_batch(rows, TRAIN, epoch=0, seed=0)
    assert skipped.tolist() == [False, False, False, True]
    assert not images[3].any() and all(images[i].any() for i in range(3))


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def test_a_removed_file_whose_name_differed_from_the_rest_keeps_the_others_in_place(
    tmp_path: Path,
):
    # x1, x2 and y: without y every remaining path shares "x", a longer common prefix.
    fs, run_path = LocalFileSystem(), str(tmp_path / "run")
    paths = [str(tmp_path / "data" / "train" / "a" / n) for n in ("x1.png", "x2.png", "y.png")]
    table = pa.table({"id": [0, 1, 2], "label": [0, 0, 0], "path": paths})
    remember_catalog(fs, run_path, table)
    now = pa.table({"id": [0, 1], "label": [0, 0], "path": paths[:2]})
    kept, stated = started_catalog(fs, run_path, now, resume=True)
    assert kept.column(GONE).to_pylist() == [False, False, True]
    assert kept.column("path").to_pylist() == paths and "1 file(s) removed" in stated[0]


def test_a_step_trains_on_the_kept_samples_over_the_whole_slice_and_a_skipped_slice_adds_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 2),
    )
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 1, 0])
    keep = torch.tensor([True, False, True, True])

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    # The kept rows alone, their summed loss over the slice of 4: a skipped sample adds 0.
    model.zero_grad()
    (F.cross_entropy(model(images[keep]), labels[keep], reduction="sum") / 4).backward()
    expected = grads(model)
    model.zero_grad()
    loss = backward_in_micro_batches(model, images, labels, 4, loss_of, keep=keep)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads(model), expected, strict=True))
    assert loss.item() == pytest.approx(
        F.cross_entropy(model(images[keep]), labels[keep], reduction="sum").item() / 4, rel=1e-5
    )
    # A slice with nothing kept: a zero gradient, batch-norm statistics untouched, still
    # training mode afterwards.
    bn = model[1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    model.zero_grad()
    loss = backward_in_micro_batches(
        model, images, labels, 4, loss_of, keep=torch.zeros(4, dtype=torch.bool)
    )
    assert loss.item() == 0.0 and all(not g.any() for g in grads(model))
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2] and model.training
