"""Start-up: launch -> first trained step, ftjob against the hand-written Ray Train loop.

Both start as fresh processes on the same 2-worker digits job (embedded Ray, small_cnn,
batch 32 per worker). The hand-written loop is what a Ray Train user writes: ray.init, a Ray
Data dataset of the decoded images, a TorchTrainer whose loop prepares the model and iterates
its shard; it stamps its first step. ftjob is `python -m ftjob +experiment=digits_ft` with one
epoch; its first step is summary.json's timing.first_step. Alternating runs, medians, ratio.

    python benchmarks/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from handwritten import WORKERS, digits_train, embedded_ray


def _raytrain_child(stamp_file: str) -> None:
    """The hand-written loop (run in a fresh process): write the time of the first step."""
    import ray.train
    import torch
    import torch.nn.functional as F
    from ray.train.torch import TorchTrainer

    from ftjob.worker.models import SmallCNN

    def loop(config: dict) -> None:
        model = ray.train.torch.prepare_model(SmallCNN(num_classes=10))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        shard = ray.train.get_dataset_shard("train")
        for batch in shard.iter_torch_batches(batch_size=32, drop_last=True):
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ray.train.get_context().get_world_rank() == 0:
                with open(config["stamp"], "w") as f:
                    f.write(str(time.time()))
            return  # the first step is all this benchmark needs

    with embedded_ray(), tempfile.TemporaryDirectory() as storage:
        _, ds = digits_train()
        TorchTrainer(
            loop,
            train_loop_config={"stamp": stamp_file},
            scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
            run_config=ray.train.RunConfig(storage_path=storage, name="startup"),
            datasets={"train": ds},
        ).fit()


def raytrain() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "first_step")
        launched = time.time()
        subprocess.run(
            [sys.executable, __file__, "--raytrain-child", stamp],
            check=True,
            capture_output=True,
            timeout=600,
        )
        with open(stamp) as f:
            return float(f.read()) - launched


def ftjob() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        launched = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "ftjob",
                "+experiment=digits_ft",
                "trainer.epochs=1",
                f"hydra.run.dir={tmp}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        with open(os.path.join(tmp, "summary.json")) as f:
            return json.load(f)["timing"]["first_step"] - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raytrain-child", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raytrain_child:
        _raytrain_child(args.raytrain_child)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    results: dict[str, list[float]] = {"raytrain": [], "ftjob": []}
    for r in range(args.repeats):
        order = [("raytrain", raytrain), ("ftjob", ftjob)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            results[name].append(fn())
            print(f"[repeat {r + 1}] {name:<9} launch -> first step {results[name][-1]:6.2f} s")
    med = {name: statistics.median(values) for name, values in results.items()}
    print(
        f"\nmedian launch -> first step: raytrain {med['raytrain']:.2f} s, ftjob {med['ftjob']:.2f} s"
    )
    print(f"startup ftjob/raytrain = {med['ftjob'] / med['raytrain']:.2f}")


if __name__ == "__main__":
    main()
