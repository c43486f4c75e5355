"""What the tests share: running ``python -m ftjob`` and reading its console, composing a job,
image trees, recording filesystems, a run ledger with a short run's records, a chaos ledger,
the loggers' read-back. Tests import them from here, never from one another; conftest.py holds
the fixtures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fsspec import AbstractFileSystem

from ftjob.config import RetryConfig
from ftjob.data.order import EpochPlan
from ftjob.driver.ledger import RunLedger
from ftjob.record import ChaosSkip, ChaosView, Kill, Restore, RunPlan, WorkerPlace
from ftjob.storage.checkpoint import (
    MANIFEST,
    CheckpointStore,
    CorruptCheckpoint,
    manifest_of,
    object_of,
)
from ftjob.storage.retry import RetryPolicy
from ftjob.storage.wrapper import DelegatingFileSystem


class RecordingFileSystem(DelegatingFileSystem):
    """Records every operation; ``fail`` decides, per (op, path), to raise instead."""

    def __init__(
        self, fs: AbstractFileSystem, fail: Callable[[str, str], BaseException | None] | None = None
    ) -> None:
        super().__init__(fs)
        self.fail = fail or (lambda op, path: None)
        self.calls: list[tuple[str, str]] = []

    def _call(self, op: str, path: str, fn: Callable[[], Any]) -> Any:
        self.calls.append((op, path))
        error = self.fail(op, path)
        if error is not None:
            raise error
        return fn()


def no_sleep_policy(max_attempts: int = 3) -> RetryPolicy:
    return RetryPolicy(
        RetryConfig(max_attempts=max_attempts, initial_backoff=0.0, jitter=0.0),
        sleep=lambda s: None,
    )


def remote(store: CheckpointStore, step: int, name: str) -> str:
    """Where file ``name`` of the checkpoint of ``step`` is stored: under its writer's own
    object name once a manifest names it."""
    if name == MANIFEST:
        return store.manifest_path(step)
    try:
        meta = store.read_manifest(step)["files"].get(name)
    except CorruptCheckpoint:
        meta = None
    return f"{store.path_for(step)}/{object_of(name, meta) if meta else name}"


def flip_bytes(store: CheckpointStore, step: int) -> None:
    data = store.fs.cat_file(remote(store, step, "model.pt"))
    store.fs.pipe_file(remote(store, step, "model.pt"), bytes(b ^ 0xFF for b in data))


PLAN = EpochPlan(num_samples=40, global_batch_size=8, seed=0)


def make_ledger(num_workers: int | None = None) -> RunLedger:
    """A ledger of a run of 5 steps of 8 samples (at most ``num_workers``: elastic)."""
    return RunLedger(
        RunPlan(
            num_samples=PLAN.num_samples,
            global_batch_size=8,
            samples_per_epoch=PLAN.samples_per_epoch,
            steps_per_epoch=PLAN.steps_per_epoch,
            seed=0,
            epochs=1,
            num_workers=num_workers,
        ),
        fail_at_steps=[3],
    )


def train(ledger: RunLedger, attempt: int, steps: range, audit: bool = True) -> None:
    for step in steps:
        ledger.step_done(attempt, step)
        if audit:
            ids = PLAN.shard(0, (step - 1) * 8, 0, 1)[:8]
            ledger.audit_step(attempt, step, 0, ids.tolist(), [])


def restored(step: int) -> Restore:
    """A restore of the checkpoint of ``step`` from storage: 0.76 s in all."""
    return Restore(
        step=step,
        epoch=0,
        position=step * 8,
        path=f"/ck/step_{step}",
        download=0.5,
        load=0.25,
        skip=0.01,
    )


WORKERS = [
    WorkerPlace(node_id="head", pid=10, rank=0),
    WorkerPlace(node_id="n1", pid=11, rank=1),
    WorkerPlace(node_id="n1", pid=12, rank=2),
    WorkerPlace(node_id="n2", pid=13, rank=3),
]


class FakeLedger:
    """The ledger as the killer sees it, driven by the test (``view``: ChaosView's fields)."""

    def __init__(self) -> None:
        self.view: dict[str, Any] = {
            "training_started": None,
            "attempt": None,
            "training": False,
            "workers": [],
            "step": 0,
        }
        self.recorded: list[Kill] = []
        self.confirmed: list[tuple[float, bool]] = []
        self.skipped: list[ChaosSkip] = []
        self.errors: list[str] = []

    def chaos_view(self) -> ChaosView:
        return ChaosView(**{**self.view, "workers": tuple(self.view["workers"])})

    def record_kill(self, record: Kill) -> None:
        self.recorded.append(record)

    def confirm_kill(self, time_of_kill: float, confirmed: bool) -> None:
        self.confirmed.append((time_of_kill, confirmed))

    def record_skip(self, record: ChaosSkip) -> None:
        self.skipped.append(record)

    def report_error(self, message: str) -> None:
        self.errors.append(message)


def compose_job(*overrides: str) -> Any:
    """The JobConfig ``python -m ftjob`` would run with these overrides (no Hydra run dir)."""
    from hydra.core.global_hydra import GlobalHydra

    from ftjob.config import load_job
    from ftjob.config.compose import Composer, Target

    try:
        return load_job(Composer().compose(Target("test"), overrides))
    finally:
        GlobalHydra.instance().clear()


def run_ftjob(
    args: list[str], tmp_path: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """Run ``python -m ftjob`` in a subprocess with its run dir under tmp_path; returns the
    process and the parsed summary.json (None if it was not written)."""
    run_dir = tmp_path / "run"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return proc, summary


def start_ftjob(args: list[str], run_dir: Path, cwd: Path) -> subprocess.Popen[str]:
    """``python -m ftjob`` in the background, its console (stdout and stderr) unbuffered on
    ``stdout``, to watch it and signal it mid-run."""
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "ftjob", *args, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ctrl_c_reaches_it,
    )


def ctrl_c_reaches_it() -> None:
    """In a child process, before it starts: SIGINT back to its default. A test suite run in
    the background of a shell (nohup ... &) ignores SIGINT, its children inherit that, and
    Python then never raises KeyboardInterrupt -- a test that sends Ctrl-C would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_until(proc: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float) -> None:
    """Read ``proc``'s console into ``lines`` until a line holds ``pattern``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if pattern in line:
            return
    raise AssertionError(f"{pattern!r} never came:\n" + "".join(lines[-40:]))


def make_image_tree(
    root: Path, classes: int = 3, train_per_class: int = 24, val_per_class: int = 6, size: int = 20
) -> Path:
    """A real class-per-folder tree of PNG files: each class a colour, plus noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = rng.integers(40, 215, size=(classes, 3))
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(colours[c] + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(
                    np.uint8
                )
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return root


def check_loggers(
    run_dir: Path,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    last_step: int,
    epochs: int,
    failures: int,
) -> None:
    """What the loggers wrote, read back with TensorBoard's, MLflow's and W&B's own readers:
    one point per logged step across the restores, params, and the failures as events."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [events] = (run_dir / "logs" / "tensorboard" / name).glob("events.*")
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == last_step, steps
    assert [e.step for e in acc.Scalars("validation/accuracy")][-1] == last_step
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{run_dir / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("ftjob").experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    assert run.data.params["trainer.epochs"] == str(epochs)
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(history) == steps
    noticed = [v for k, v in run.data.tags.items() if k.startswith("event.") and "failure" in v]
    assert len(noticed) >= failures
    assert (run_dir / "logs" / "metrics.csv").stat().st_size > 0
    # Weights & Biases (offline), read back with wandb's own reader of its run log.
    records = wandb_records(run_dir)
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    assert [h["trainer/step"] for h in history if "train/loss" in h] == steps  # once each
    assert any(h.get("events._type") == "table-file" for h in history)
    [started] = [r["run"] for r in records if r.get("type") == "run"]
    assert started["display_name"] == name
    assert wandb_config(records)["trainer.epochs"] == str(epochs)
    assert [r["exit"]["exit_code"] for r in records if r.get("type") == "exit"] == [0]


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of an offline W&B run under ``run_dir``, as ``wandb leet inspect`` reads
    its transaction log."""
    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's config as its records left it (the run's start, then each update)."""
    config: dict[str, Any] = {}
    for record in records:
        body = record.get("config") or (record.get("run") or {}).get("config") or {}
        config.update(body.get("update") or {})
    return config


def manifest_in(fs: AbstractFileSystem, directory: str) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory`` (a step's, or a quarantined one)."""
    names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)]
    name = manifest_of(names)
    assert name is not None, f"no manifest in {directory}: {names}"
    return json.loads(fs.cat_file(f"{directory.rstrip('/')}/{name}"))


def tagged_checkpoint(root: str, tag: str, step: int) -> str:
    """A local checkpoint directory whose every file says who wrote it, for which step."""
    local = os.path.join(root, f"{tag}_{step}")
    os.makedirs(local, exist_ok=True)
    for name in ("model.pt", "optimizer.pt", "state.json"):
        with open(os.path.join(local, name), "w") as f:
            f.write(f"{tag} {name} step {step}\n")
    return local


def zombie_commit(fs: AbstractFileSystem, run_path: str, scratch: str) -> BaseException:
    """Driver A passes the fence, freezes inside its first upload of step 10 (a SIGSTOP, a VM
    pause, a partition riding out its retries); meanwhile its lease lapses, driver B takes the
    run over, restores step 5, commits its own step 10 and prunes to one checkpoint; then A
    wakes and finishes. Returns what A's commit raised."""
    from ftjob.storage.lease import RunLease

    a = RunLease(fs, run_path, 60.0, owner="host-a:1")
    a.acquire()
    CheckpointStore(fs, run_path, a.fence()).commit(tagged_checkpoint(scratch, "A", 5), 5)

    def b_takes_over() -> None:
        a.release()  # as the store sees it, the same as a lease that expired
        b = RunLease(fs, run_path, 60.0, owner="host-b:2")
        b.acquire()
        store = CheckpointStore(fs, run_path, b.fence(), attempt=0)
        assert store.restore_latest(os.path.join(scratch, "restore-b")).step == 5
        store.commit(tagged_checkpoint(scratch, "B", 10), 10)
        assert store.prune(1) == [5]

    frozen = {"done": False}

    def freeze_once(op: str, path: str) -> None:
        if op == "put_file" and not frozen["done"]:
            frozen["done"] = True
            b_takes_over()

    zombie = CheckpointStore(RecordingFileSystem(fs, freeze_once), run_path, a.fence())
    try:
        zombie.commit(tagged_checkpoint(scratch, "A", 10), 10)
    except Exception as exc:
        return exc
    raise AssertionError("the deposed driver's commit succeeded")
