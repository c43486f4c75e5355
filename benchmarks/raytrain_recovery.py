"""The engine underneath, recovering: a hand-written Ray Train loop on the digits job, with
worker kills, for benchmarks/recovery.py's side-by-side (kind ``raytrain worker kill``).

The loop is what a careful Ray Train user writes: a Ray Data dataset of the decoded images, a
TorchTrainer whose loop restores ``ray.train.get_checkpoint()`` (model, optimizer, epoch),
prepares the model and iterates its shard, and reports a checkpoint at every epoch's end (a Ray
Data shard cannot resume mid-epoch); ``FailureConfig(max_failures=4)``. The same shape as
digits_ft: small_cnn, 2 workers, batch 32 per worker, AdamW at 3e-3, the training workers' CPUs
on top of the machine's for Ray Data's decode. A thread in the driver SIGKILLs one training
worker process (a random rank) on ftjob's worker-kill schedule: one per ``interval`` window
after the first step, each once training runs again. Rank 0 stamps the train function's entry
and every step; from them, per kill: kill -> train function (Ray Train's detection and
restart), train function -> first step (the loop's own set-up: model, restore, the shard's
first batch, the step), time-to-recover, and the steps trained again. Ray Train polls its
workers every 0.5 s, as under ftjob's default ``failure.health_check_interval`` (Ray's own
default is 2 s): both sides get the same detection from the same engine.

Runs in a fresh process, with its own Ray:
``python benchmarks/raytrain_recovery.py OUT.json SEED EPOCHS INTERVAL KILLS``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

from handwritten import WORKERS, digits_train, embedded_ray

BATCH = 32
HEALTH_CHECK_INTERVAL_S = 0.5  # ftjob's default failure.health_check_interval


def _loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.nn.functional as F

    from ftjob.worker.models import SmallCNN

    entered = time.time()
    rank = ray.train.get_context().get_world_rank()
    stamps = config["stamps"]
    with open(os.path.join(stamps, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    out = open(os.path.join(stamps, "steps"), "a") if rank == 0 else None  # noqa: SIM115
    if out is not None:
        out.write(f"enter {os.getpid()} {entered} -1\n")
        out.flush()
    model = SmallCNN(num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start_epoch, steps_per_epoch = 0, config["steps_per_epoch"]
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start_epoch, config["epochs"]):
        for i, batch in enumerate(shard.iter_torch_batches(batch_size=BATCH, drop_last=True)):
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if out is not None:
                out.write(f"step {os.getpid()} {time.time()} {epoch * steps_per_epoch + i + 1}\n")
                out.flush()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": opt.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(d, "state.pt"))
            ckpt = ray.train.Checkpoint.from_directory(d) if rank == 0 else None
            ray.train.report({"epoch": epoch}, checkpoint=ckpt)


def _steps_after(path: str, t: float) -> bool:
    """Has rank 0 stamped a step after time ``t``?"""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return any(
            line.startswith("step ") and float(line.split()[2]) > t for line in f.readlines()
        )


def _killer(stamps: str, interval: float, max_kills: int, seed: int, kills: list) -> None:
    """As ftjob's worker killer: kill k is due k intervals plus a random part of one after the
    first step, once training runs again after the previous kill; SIGKILL a random rank."""
    from ftjob.chaos.schedule import KillSchedule

    rng = random.Random(seed)
    steps = os.path.join(stamps, "steps")
    while not _steps_after(steps, 0.0):
        time.sleep(0.05)
    start, last = time.time(), 0.0
    for due in KillSchedule(interval, max_kills, seed=seed).times():
        while time.time() < start + due or not _steps_after(steps, last):
            time.sleep(0.05)
        rank = rng.randrange(WORKERS)
        with open(os.path.join(stamps, f"pid-{rank}")) as f:
            pid = int(f.read())
        os.kill(pid, signal.SIGKILL)
        last = time.time()
        kills.append({"time": last, "pid": pid, "rank": rank})


def recoveries(lines: list[str], kills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kill, from rank 0's stamps: kill -> train function entry, entry -> first step,
    time-to-recover, and the steps trained again."""
    events = [(kind, int(pid), float(t), int(step)) for kind, pid, t, step in map(str.split, lines)]
    out = []
    for kill in kills:
        before = [s for kind, _, t, s in events if kind == "step" and t < kill["time"]]
        entry = next(e for e in events if e[0] == "enter" and e[2] > kill["time"])
        first = next(e for e in events if e[0] == "step" and e[2] > entry[2])
        out.append(
            {
                "to_train_fn_s": entry[2] - kill["time"],
                "train_fn_to_step_s": first[2] - entry[2],
                "time_to_recover_s": first[2] - kill["time"],
                "lost_steps": max(0, max(before, default=0) - (first[3] - 1)),
            }
        )
    return out


def child(out_path: str, seed: int, epochs: int, interval: float, max_kills: int) -> None:
    import ray.train
    from ray.train.torch import TorchTrainer

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(HEALTH_CHECK_INTERVAL_S)
    kills: list[dict[str, Any]] = []
    with (
        embedded_ray(),
        tempfile.TemporaryDirectory() as storage,
        tempfile.TemporaryDirectory() as stamps,
    ):
        rows, ds = digits_train()
        killer = threading.Thread(
            target=_killer, args=(stamps, interval, max_kills, seed, kills), daemon=True
        )
        killer.start()
        TorchTrainer(
            _loop,
            train_loop_config={
                "stamps": stamps,
                "epochs": epochs,
                "steps_per_epoch": rows // (BATCH * WORKERS),
            },
            scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
            run_config=ray.train.RunConfig(
                storage_path=storage,
                name="recovery",
                failure_config=ray.train.FailureConfig(max_failures=4),
            ),
            datasets={"train": ds},
        ).fit()
        with open(os.path.join(stamps, "steps")) as f:
            lines = f.read().splitlines()
    with open(out_path, "w") as f:
        json.dump(recoveries(lines, kills), f)


if __name__ == "__main__":
    out, seed, epochs, interval, max_kills = sys.argv[1:6]
    child(out, int(seed), int(epochs), float(interval), int(max_kills))
