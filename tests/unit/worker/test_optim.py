"""The optimizer group (torch.optim as Hydra partials) and the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from ftjob.config import ConfigError, load_job
from ftjob.config.compose import Composer, Target
from ftjob.worker.optim import LRSchedule, build_optimizer


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


def test_the_linear_scaling_rule_and_warmup_epochs_set_the_schedule():
    from ftjob.config import TrainerConfig

    trainer = TrainerConfig(num_workers=8, batch_size=128, lr=0.1, lr_reference_batch=256)
    trainer.warmup_epochs, trainer.epochs = 5, 90
    schedule = LRSchedule.for_trainer(trainer, steps_per_epoch=1251)
    assert schedule.peak == pytest.approx(0.4)  # 0.1 x 1024 / 256
    assert schedule.warmup_steps == 5 * 1251 and schedule.total_steps == 90 * 1251
    plain = LRSchedule.for_trainer(TrainerConfig(lr=0.05, warmup_steps=7), steps_per_epoch=10)
    assert (plain.peak, plain.warmup_steps) == (0.05, 7)


def test_biases_and_norm_weights_can_be_kept_out_of_weight_decay():
    from ftjob.worker.optim import parameter_groups

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    job = load_job(
        Composer().compose(Target("test"), ["optimizer=sgd", "optimizer.weight_decay=1e-4"])
    )
    optimizer = build_optimizer(job.optimizer, parameter_groups(model, False), 0.1)
    decayed, plain = optimizer.param_groups
    assert [p.ndim for p in decayed["params"]] == [4] and decayed["weight_decay"] == 1e-4
    assert (
        len(plain["params"]) == 3 and plain["weight_decay"] == 0.0
    )  # conv bias, BN weight and bias
    [single] = build_optimizer(job.optimizer, parameter_groups(model), 0.1).param_groups
    assert len(single["params"]) == 4


def test_label_smoothing_is_checked():
    from ftjob.config import TrainerConfig

    with pytest.raises(ConfigError, match="trainer.label_smoothing"):
        TrainerConfig(label_smoothing=1.0)
    with pytest.raises(ConfigError, match="trainer.lr_reference_batch"):
        TrainerConfig(lr_reference_batch=0)
