"""Exact mode (trainer.exact=true) in whole jobs in this process: the same job at world 1, 2
and 4 ends with the same weights and buffers, bit for bit -- which data parallel training
does not -- and so does a run restored from the memory tier and from storage; a micro-batch
count that is not a power of two (the grid's sum) at world 1 and 3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.exact import differing, final_weights
from tests.support.jobs import compose_job
from tests.support.local_run import LocalRun, run_locally

pytestmark = pytest.mark.worker

# 512 synthetic 16-pixel images: 8 steps of a global batch of 64, in 4 micro-batches of 16 (4
# on one rank, 2 on each of two, 1 on each of four); a model with BatchNorm and dropout.
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
# Four (three) ranks in this process's gloo group share a machine of fewer cores: said.
WORLD_4 = ("trainer.num_workers=4", "trainer.batch_size=16", "ray.oversubscribe=true")
WORLDS = {2: WORLD_2, 4: WORLD_4}
BATCH_NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
EXACT = ("trainer.exact=true",)


def run(run_dir: Path, *overrides: str) -> LocalRun:
    done = run_locally(compose_job(*JOB, *overrides), run_dir)
    assert done.summary["status"] == "succeeded", (done.summary["error"], done.errors)
    return done


@pytest.fixture(scope="module")
def exact_world_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The unkilled exact run at world 1: the weights every exact run of the job must end with."""
    return final_weights(run(tmp_path_factory.mktemp("exact_world_1"), *EXACT, *WORLD_1).summary)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_exact_mode_trains_the_same_weights_and_buffers_at_world_1_2_and_4(
    tmp_path: Path, exact_world_1: dict[str, torch.Tensor], world: int
):
    other = final_weights(run(tmp_path, *EXACT, *WORLDS[world]).summary)
    # Weights and buffers: BatchNorm's running statistics, updated once a step.
    assert int(other["features.0.1.num_batches_tracked"]) == 8
    assert exact_world_1.keys() == other.keys()
    assert differing(exact_world_1, other) == []


@pytest.fixture(scope="module")
def normal_world_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return final_weights(run(tmp_path_factory.mktemp("normal_world_1"), *WORLD_1).summary)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_without_exact_mode_the_same_comparison_differs(
    tmp_path: Path, normal_world_1: dict[str, torch.Tensor], world: int
):
    other = final_weights(run(tmp_path, *WORLDS[world]).summary)
    # Summed in another order on several ranks, and BatchNorm follows rank 0's share of the
    # batch: learned weights differ, not only the statistics' counts.
    learned = [n for n in differing(normal_world_1, other) if not n.endswith(BATCH_NORM_STATISTICS)]
    assert learned != []


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


def test_six_micro_batches_a_step_on_the_grid_train_the_same_weights_at_world_1_and_3(
    tmp_path: Path,
):
    # A global batch of 48 in 6 micro-batches of 8: not a power of two, so summed on the grid.
    six = (*EXACT, "trainer.micro_batch_size=8", "dataset.num_samples=192")
    one = run(tmp_path / "one", *six, "trainer.num_workers=1", "trainer.batch_size=48")
    three = run(
        tmp_path / "three",
        *six,
        "trainer.num_workers=3",
        "trainer.batch_size=16",
        "ray.oversubscribe=true",
    )
    assert differing(final_weights(one.summary), final_weights(three.summary)) == []


def test_without_a_micro_batch_size_the_same_job_trains_the_same_weights_at_world_1_and_2(
    tmp_path: Path,
):
    # trainer.micro_batch_size unset: exact mode cuts the global batch of 64 by itself alone
    # (8 micro-batches of 8), not by a rank's batch_size (64 at world 1, 32 at world 2).
    job = tuple(o for o in JOB if not o.startswith("trainer.micro_batch_size="))
    runs = {
        world: run_locally(compose_job(*job, *EXACT, *shape), tmp_path / str(world))
        for world, shape in {1: WORLD_1, 2: WORLD_2}.items()
    }
    for done in runs.values():
        assert done.summary["status"] == "succeeded", (done.summary["error"], done.errors)
    assert differing(final_weights(runs[1].summary), final_weights(runs[2].summary)) == []
    for done in runs.values():
        assert "the global batch 64 in 8 micro-batches of 8" in " ".join(done.prep.notes)
