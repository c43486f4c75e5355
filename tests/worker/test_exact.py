"""Exact mode (trainer.exact=true) in whole jobs in this process: the same job at world 1 and
world 2 ends with the same weights and buffers, bit for bit -- which data parallel training
does not -- and so does a run restored from the memory tier and from storage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.exact import differing, final_weights
from tests.support.jobs import compose_job
from tests.support.local_run import LocalRun, run_locally

pytestmark = pytest.mark.worker

# 512 synthetic 16-pixel images: 8 steps of a global batch of 64, in micro-batches of 16; a
# model with BatchNorm and dropout.
JOB = (
    "+experiment=digits_ft",
    "dataset=synthetic",
    "dataset.num_samples=512",
    "dataset.num_val_samples=64",
    "dataset.image_size=16",
    "model.width=8",
    "model.dropout=0.3",
    "trainer.epochs=1",
    "trainer.validate_every_n_steps=0",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.micro_batch_size=16",
    "chaos=disabled",
)
WORLD_1 = ("trainer.num_workers=1", "trainer.batch_size=64")
WORLD_2 = ("trainer.num_workers=2", "trainer.batch_size=32")
EXACT = ("trainer.exact=true",)


def run(run_dir: Path, *overrides: str) -> LocalRun:
    done = run_locally(compose_job(*JOB, *overrides), run_dir)
    assert done.summary["status"] == "succeeded", (done.summary["error"], done.errors)
    return done


@pytest.fixture(scope="module")
def exact_world_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The unkilled exact run at world 1: the weights every exact run of the job must end with."""
    return final_weights(run(tmp_path_factory.mktemp("exact_world_1"), *EXACT, *WORLD_1).summary)


def test_exact_mode_trains_the_same_weights_and_buffers_at_world_1_and_2(
    tmp_path: Path, exact_world_1: dict[str, torch.Tensor]
):
    world_2 = final_weights(run(tmp_path, *EXACT, *WORLD_2).summary)
    # Weights and buffers: BatchNorm's running statistics, updated once a step.
    assert int(world_2["features.0.1.num_batches_tracked"]) == 8
    assert exact_world_1.keys() == world_2.keys()
    assert differing(exact_world_1, world_2) == []


def test_without_exact_mode_the_same_comparison_differs(tmp_path: Path):
    one = final_weights(run(tmp_path / "1", *WORLD_1).summary)
    two = final_weights(run(tmp_path / "2", *WORLD_2).summary)
    # Summed in another order on 2 ranks, and BatchNorm follows rank 0's half of the batch.
    assert differing(one, two) != []


def test_an_exact_run_restored_from_the_memory_tier_and_from_storage_ends_bit_identical(
    tmp_path: Path, exact_world_1: dict[str, torch.Tensor]
):
    # Snapshots every 2 steps, durable checkpoints every 3: step 5 fails and restores the
    # snapshot of step 4 (newer than the checkpoint of 3); step 7 fails and restores the
    # checkpoint of step 6 from storage (the snapshot of 6 is no newer).
    memory = ("checkpoint.memory.enabled=true", "checkpoint.memory.every_n_steps=2")
    done = run(tmp_path, *EXACT, *WORLD_1, *memory, "chaos.fail_at_steps=[5,7]")
    restored = [(f["tier"], f["restored_step"]) for f in done.summary["failures"]]
    assert restored == [("memory", 4), ("storage", 6)]
    assert differing(exact_world_1, final_weights(done.summary)) == []
