"""The optimizer group (torch.optim as Hydra partials) and the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from ftjob.compose import Composer, Target
from ftjob.config import ConfigError, load_job
from ftjob.optim import LRSchedule, build_optimizer


def test_lr_schedule_is_a_function_of_the_step():
    schedule = LRSchedule(0.1, "cosine", warmup_steps=10, total_steps=110)
    assert schedule(0) == pytest.approx(0.01)
    assert schedule(10) == pytest.approx(0.1)
    assert schedule(60) == pytest.approx(0.05)
    assert schedule(110) == pytest.approx(0.0, abs=1e-12)
    assert LRSchedule(0.1, "constant", total_steps=100)(99) == 0.1


@pytest.mark.parametrize(
    ("option", "cls"),
    [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)],
)
def test_each_optimizer_option_builds_with_the_models_parameters(option, cls):
    job = load_job(Composer().compose(Target("test"), [f"optimizer={option}", "trainer.lr=0.05"]))
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(job.optimizer, model.parameters(), job.trainer.lr)
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["lr"] == 0.05
    assert len(optimizer.param_groups[0]["params"]) == 2


def test_optimizer_keys_are_config_and_checked_against_the_class():
    job = load_job(
        Composer().compose(
            Target("test"), ["optimizer=sgd", "optimizer.momentum=0.5", "optimizer.nesterov=true"]
        )
    )
    optimizer = build_optimizer(job.optimizer, torch.nn.Linear(2, 2).parameters(), 0.1)
    assert optimizer.defaults["momentum"] == 0.5 and optimizer.defaults["nesterov"] is True
    with pytest.raises(ConfigError, match="optimizer.betas"):
        load_job(
            Composer().compose(Target("test"), ["optimizer=sgd", "+optimizer.betas=[0.9,0.9]"])
        )


def test_a_target_that_is_not_an_optimizer_is_refused():
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        build_optimizer({"_target_": "collections.OrderedDict"}, [], 0.1)
