"""``trainer.decode_in=device`` in whole jobs in this process (tests/support/local_run.py), the
device being this CPU: the encoded files read by the decode pool, each batch decoded and
augmented by the device path. Against ``decode_in=worker`` (PIL) on the same JPEG files, from
an image folder and from Parquet shards of it: the same data order, exact-once audit and
resume position across a restart, and -- the pixels being the same -- the same training to the
last bit of the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftjob import metrics as M
from ftjob.data.datasets import TRAIN, VAL
from ftjob.data.to_parquet import convert
from tests.support.images import awkward_files, jpeg, photo_like
from tests.support.jobs import compose_job
from tests.support.local_run import run_locally
from tests.support.summaries import exactly_once

# 40x32 JPEGs cropped to 24 px (validation: 28 then 24): PIL's draft mode, which decodes a large
# JPEG at a reduced scale, never applies, so the two paths' pixels are the same.
WIDTH, HEIGHT, SIZE, RESIZE = 40, 32, 24, 28


def jpeg_tree(root: Path, per_class: int = 12, val: int = 3) -> Path:
    for split, count in ((TRAIN, per_class), (VAL, val)):
        for c in range(3):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = photo_like(1000 * c + i + (500 if split == VAL else 0), WIDTH, HEIGHT)
                pixels[..., c] = pixels[..., c] // 2 + 120  # a class each: a model learns them
                (folder / f"{i:02d}.jpg").write_bytes(jpeg(pixels))
    return root


def job(dataset: str, data: Path, decode_in: str, *overrides: str) -> Any:
    return compose_job(
        "+experiment=digits_ft",
        f"dataset={dataset}",
        f"dataset.path={data}",
        f"dataset.image_size={SIZE}",
        f"dataset.resize_size={RESIZE}",
        f"trainer.decode_in={decode_in}",
        "trainer.epochs=2",
        "trainer.num_workers=1",
        "trainer.batch_size=6",
        "trainer.validate_every_n_steps=0",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.audit_samples=true",
        "checkpoint.memory.enabled=false",
        *overrides,
    )


def essentials(run: Any) -> dict[str, Any]:
    s = run.summary
    assert s["status"] == "succeeded", (s["error"], run.errors)
    assert all(exactly_once(epoch) and epoch["unique"] == 36 for epoch in s["audit"])
    return {
        "audit": s["audit"],
        "batches": s["audit_batches"],
        "restored": [(f["restored_step"], f["lost_steps"]) for f in s["failures"]],
        "loss": (s["metrics"]["validation/loss"], s["metrics"]["validation/accuracy"]),
        "history": [(h["step"], h["loss"]) for h in s["history"]],
    }


@pytest.mark.worker
def test_device_decode_trains_as_the_worker_does_from_a_folder_and_from_parquet(tmp_path: Path):
    tree = jpeg_tree(tmp_path / "tree")
    shards = tmp_path / "shards"
    convert(str(tree), str(shards), 12, rows_per_group=6, shuffle=False)
    fail = "chaos.fail_at_steps=[5]"  # restored from step 4: the position from the checkpoint
    runs = {}
    for dataset, data in (("imagefolder", tree), ("parquet", shards)):
        extra = ("dataset.shuffle_window=0",) if dataset == "parquet" else ()
        for place in ("worker", "device"):
            run = run_locally(
                job(dataset, data, place, fail, *extra), tmp_path / f"{dataset}-{place}"
            )
            runs[(dataset, place)] = run
            metrics = run.summary["metrics"]
            assert metrics[M.DATA_DECODE_PLACE] == M.DECODE_PLACES[place]
            assert run.summary["data"]["decode"]["place"] == place
            assert any("data: rank 0 decodes" in line for line in run.lines)
            decoded = metrics[M.DATA_DEVICE_DECODED]
            assert (decoded > 0) == (place == "device"), (dataset, place, decoded)
    for dataset in ("imagefolder", "parquet"):
        worker, device = (essentials(runs[(dataset, p)]) for p in ("worker", "device"))
        assert worker["restored"] == device["restored"] == [(4, 1)]
        assert device == worker, dataset  # order, audit, resume and every loss: the same
    assert essentials(runs[("imagefolder", "device")])["loss"][1] > 0.5  # it learned


@pytest.mark.worker
def test_awkward_files_in_a_device_decoded_run_fall_back_and_a_bad_one_is_skipped(tmp_path: Path):
    # 96 good files and 4 awkward ones: one bad file in 100, within bad_files' 1 %.
    tree = jpeg_tree(tmp_path / "tree", per_class=32)
    folder = tree / TRAIN / "c0"
    for kind, data in awkward_files(photo_like(77, WIDTH, HEIGHT)).items():
        (folder / f"zz_{kind}.{'png' if kind == 'png' else 'jpg'}").write_bytes(data)
    skip = ("dataset.bad_files=skip", "trainer.batch_size=10")
    run = run_locally(job("imagefolder", tree, "device", *skip), tmp_path / "run")
    s = run.summary
    assert s["status"] == "succeeded", (s["error"], run.errors)
    [bad] = s["data"]["skipped_files"]
    assert bad["path"].endswith("zz_truncated.jpg")
    m = s["metrics"]
    fallbacks = {key[len(M.DATA_FALLBACK) :]: m[key] for key in M.DATA_FALLBACKS}
    # Each awkward file is met once an epoch, the truncated one too (then skipped).
    assert fallbacks == {
        "format": 2,
        "progressive": 2,
        "cmyk": 2,
        "layout": 0,
        "truncated": 2,
        "refused": 0,
    }
    assert all(exactly_once(epoch) and epoch["skipped"] == 1 for epoch in s["audit"])
