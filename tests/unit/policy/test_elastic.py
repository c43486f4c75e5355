"""Elastic training without Ray: the micro-batch split of one global batch at every world
size, the gradient it gives, the config it refuses, and the records of a run that shrank after
a node loss and grew back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ftjob.config import ConfigError, TrainerConfig
from ftjob.policy.elastic import micro_batches
from ftjob.policy.hang import restart_loop
from ftjob.record import Attempt, Notice, NoticeSource
from ftjob.worker.backward import backward_in_micro_batches

GLOBAL, BATCH = 64, 16  # trainer.batch_size 16 x trainer.num_workers 4


@pytest.mark.parametrize(
    ("world", "expected"),
    [
        (4, [(0, 16)]),
        (2, [(0, 16), (16, 32)]),
        (1, [(0, 16), (16, 32), (32, 48), (48, 64)]),
    ],
)
def test_each_rank_splits_its_slice_into_micro_batches_of_batch_size(world, expected):
    assert micro_batches(GLOBAL // world, BATCH) == expected
    # Every world size trains the whole global batch, never more than BATCH at once.
    assert world * sum(hi - lo for lo, hi in expected) == GLOBAL
    assert max(hi - lo for lo, hi in expected) <= BATCH


def test_a_slice_that_batch_size_does_not_divide_ends_in_a_smaller_micro_batch():
    assert micro_batches(48, 32) == [(0, 32), (32, 48)]  # 96 = 32 x 3 workers, on 2
    with pytest.raises(ValueError):
        micro_batches(0, 32)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_averaged_gradient_is_the_global_batch_mean_at_every_world_size(world):
    """What DDP all-reduces (the mean over ranks of each rank's accumulated gradient) equals the
    gradient of the whole global batch's mean loss: a shrink changes no update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    x, y = torch.randn(GLOBAL, 8), torch.randint(0, 5, (GLOBAL,))
    F.cross_entropy(model(x), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]

    summed = [torch.zeros_like(p) for p in model.parameters()]
    per_rank = GLOBAL // world
    losses = []
    for rank in range(world):
        model.zero_grad()
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = backward_in_micro_batches(
            model, x[sl], y[sl], BATCH, lambda a, b: F.cross_entropy(model(a), b)
        )
        losses.append(loss)
        for total, p in zip(summed, model.parameters(), strict=True):
            total += p.grad
    for total, ref in zip(summed, reference, strict=True):
        torch.testing.assert_close(total / world, ref, rtol=1e-5, atol=1e-6)
    assert float(sum(losses) / world) == pytest.approx(float(F.cross_entropy(model(x), y).detach()))


def test_elastic_config_is_checked_before_ray_starts():
    assert TrainerConfig(num_workers=4, batch_size=24, min_workers=2).elastic  # 96: 2, 3, 4
    assert not TrainerConfig(num_workers=2, min_workers=2).elastic  # min = max: fixed size
    with pytest.raises(ConfigError) as err:
        TrainerConfig(num_workers=2, min_workers=3)
    assert err.value.key == "trainer.min_workers" and "between 1 and" in err.value.rule
    with pytest.raises(ConfigError) as err:
        TrainerConfig(num_workers=4, batch_size=32, min_workers=2)  # 128 over 3 workers
    assert err.value.key == "trainer.min_workers" and err.value.value == 2
    assert "global batch 128" in err.value.rule and "over 3 workers" in err.value.rule
    with pytest.raises(ConfigError) as err:
        TrainerConfig(resize_interval=0)
    assert err.value.key == "trainer.resize_interval"


def test_attempts_ended_by_planned_resizes_are_no_restart_loop():
    resize = Notice(NoticeSource.resize, 0.0, 6)
    attempts = [
        Attempt(0, 0.0, max_step=7),
        Attempt(1, 1.0, max_step=6, resize=resize),  # shrunk: restored to 5
        Attempt(2, 2.0, max_step=6, resize=resize),
        Attempt(3, 3.0, max_step=6, resize=resize),
        Attempt(4, 4.0),  # just started
    ]
    assert restart_loop(attempts, 3, 1) is None
    failed = [dataclasses.replace(a, resize=None) for a in attempts]
    assert restart_loop(failed, 3, 1) is not None
