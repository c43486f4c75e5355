"""Where a run decodes (``trainer.decode_in``): the places ``auto`` weighs, its probe on the
first batch (the device measured here on the CPU: the same code a GPU runs), and the choice
kept for the whole run -- by the run ledger across attempts, by a checkpoint's metrics across
drivers -- so no rank or attempt decodes another way. No Ray: the worker's context is this
process's, told it is on a Ray cluster."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ftjob import metrics as M
from ftjob.actors import DirectHandle
from ftjob.data.datasets import TRAIN, DigitsDataset, ImageFolderDataset, SyntheticDataset
from ftjob.data.decode_place import auto_places, fastest, probe, probe_line
from ftjob.data.order import EpochPlan
from ftjob.data.streams import numpy_rows
from ftjob.driver.ledger import RunLedger
from ftjob.record import DecodeChoice, RunPlan
from ftjob.worker.checkpointer import TrainState
from ftjob.worker.context import local_context
from ftjob.worker.loop import decode_place
from tests.support.images import photo_tree


def folder(tmp_path: Path) -> ImageFolderDataset:
    root = photo_tree(tmp_path, classes=2, train_per_class=4, val_per_class=1)
    return ImageFolderDataset(path=str(root), image_size=64, resize_size=72)


def test_auto_weighs_the_places_a_worker_has():
    synthetic, digits = SyntheticDataset(num_samples=8), DigitsDataset()
    # CPU training keeps its rule of cores: one place, no probe.
    assert auto_places(False, False, synthetic, 2, 2, 1.0, 1.0, True)[0] == ["worker"]
    assert auto_places(False, False, synthetic, 8, 2, 1.0, 1.0, True)[0] == ["ray"]
    # A GPU worker: its device where the images can be made there, its pool, and Ray Data
    # where the machine has cores beside the workers' reservations.
    assert auto_places(True, True, synthetic, 16, 1, 4.0, 1.0, True)[0] == [
        "device",
        "worker",
        "ray",
    ]
    assert auto_places(True, True, digits, 16, 1, 16.0, 1.0, True)[0] == ["worker"]
    assert auto_places(True, False, synthetic, 16, 2, 8.0, 1.0, True)[0] == ["worker"]


def test_the_probe_measures_each_place_on_the_first_batch(tmp_path):
    ds = folder(tmp_path)
    rows = numpy_rows(ds.catalog(TRAIN))
    rates = probe(
        ds, rows, ["device", "worker", "ray"], seed=0, device="cpu", threads=2, ray_share_cores=6
    )
    assert set(rates) == {"device", "worker", "ray"} and all(r > 0 for r in rates.values())
    # Ray Data's rate is estimated from the pool's a thread: 6 cores at RAY_DATA_SHARE each.
    assert abs(rates["ray"] - rates["worker"] / 2 * 6 * 0.34) <= 0.2
    chosen = fastest(rates, ["device", "worker", "ray"])
    assert rates[chosen] == max(rates.values())
    line = probe_line(chosen, rates)
    assert line.startswith("auto's probe, images/s: ") and "(ray: estimated)" in line


def worker_view(ledger: RunLedger, cores: float = 16.0) -> object:
    """A rank-0 context that says it is a Ray worker on a 16-core machine (no decode_here)."""
    ctx = local_context(DirectHandle(ledger))
    return dataclasses.replace(ctx, decode_here=False, machine=lambda: (cores, True))


def choose(ds: object, ledger: RunLedger, metrics: M.MetricSet) -> str:
    trainer = dataclasses.make_dataclass(
        "T",
        [
            ("decode_in", str, "auto"),
            ("use_gpu", bool, True),
            ("worker_cpus", float, 4.0),
            ("decode_cpus", float, 1.0),
            ("seed", int, 0),
        ],
    )()
    catalogs = {TRAIN: ds.catalog(TRAIN)}  # type: ignore[attr-defined]
    plan = EpochPlan(catalogs[TRAIN].num_rows, 4, 0)
    ctx = worker_view(ledger)
    return decode_place(ds, catalogs, trainer, ctx, plan, TrainState(), metrics)  # type: ignore[arg-type]


def test_auto_probes_once_and_the_run_keeps_its_choice(tmp_path, monkeypatch):
    import ftjob.worker.loop as loop

    ds = folder(tmp_path)
    ledger = RunLedger(RunPlan())
    calls = []
    real = loop.probe
    monkeypatch.setattr(loop, "probe", lambda *a, **k: calls.append(1) or real(*a, **k))
    metrics = M.MetricSet()
    first = choose(ds, ledger, metrics)
    assert calls == [1] and first in ("worker", "ray")  # a CPU here: no device to weigh
    assert metrics.get(M.DATA_DECODE_PLACE) == M.DECODE_PLACES[first]
    assert metrics.get(M.DATA_PROBE + "worker") > 0
    said = [line for line in ledger.lines if line.startswith("data: rank 0 decodes")]
    assert len(said) == 1 and "auto's probe, images/s" in said[0]
    snap = ledger.snapshot().decode
    assert snap is not None and snap.place == first and "worker" in snap.rates
    # A restarted attempt of the same driver asks the ledger: the same place, no probe.
    assert choose(ds, ledger, M.MetricSet()) == first and calls == [1]
    # A resumed run (a new driver, a new ledger) keeps its checkpoint's place, whatever a
    # probe would say now.
    kept = M.MetricSet()
    other = "ray" if first == "worker" else "worker"
    kept.set(M.DATA_DECODE_PLACE, M.DECODE_PLACES[other])
    fresh = RunLedger(RunPlan())
    assert choose(ds, fresh, kept) == other and calls == [1]
    decision = fresh.snapshot().decode
    assert decision == DecodeChoice(other, "the run's, kept")


def test_a_set_place_is_the_runs_and_a_dataset_without_images_to_decode_stays_in_the_worker():
    ledger = RunLedger(RunPlan())
    digits = DigitsDataset()
    catalogs = {TRAIN: digits.catalog(TRAIN)}
    trainer = dataclasses.make_dataclass(
        "T", [("decode_in", str, "device"), ("use_gpu", bool, False), ("seed", int, 0)]
    )()
    plan = EpochPlan(catalogs[TRAIN].num_rows, 4, 0)
    metrics = M.MetricSet()
    ctx = worker_view(ledger)
    place = decode_place(digits, catalogs, trainer, ctx, plan, TrainState(), metrics)  # type: ignore[arg-type]
    assert place == "worker" and metrics.get(M.DATA_DECODE_PLACE) == 1
    assert "has no images to decode there" in ledger.snapshot().decode.reason  # type: ignore[union-attr]
    assert metrics.get(M.DATA_PROBE + "device") == 0.0  # nothing was probed
