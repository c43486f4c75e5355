"""``trainer.*`` rules that span keys: exact mode's micro-batch when none is given."""

from __future__ import annotations

import pytest

from ftjob.config import ConfigError, TrainerConfig
from ftjob.config.trainer import exact_micro_batch


def test_exact_modes_default_micro_batch_is_a_function_of_the_global_batch_alone():
    one = TrainerConfig(exact=True, num_workers=1, batch_size=64)
    two = TrainerConfig(exact=True, num_workers=2, batch_size=32)
    four = TrainerConfig(exact=True, num_workers=4, batch_size=16)
    assert one.micro_batch == two.micro_batch == four.micro_batch == 8
    # The fewest micro-batches from 8 up that divide the global batch; one sample each where
    # none does.
    assert [exact_micro_batch(g) for g in (2048, 96, 100, 7, 1)] == [256, 12, 10, 1, 1]
    # Given, it is used as given; without exact mode null is a rank's batch_size.
    assert TrainerConfig(exact=True, num_workers=2, micro_batch_size=16).micro_batch == 16
    assert TrainerConfig(num_workers=2, batch_size=32).micro_batch == 32


def test_a_default_micro_batch_some_world_size_cannot_split_is_refused_naming_the_key():
    # 24 over 3 ranks is 8 a rank: not whole micro-batches of 3 (the global batch 24 in 8).
    with pytest.raises(ConfigError) as err:
        TrainerConfig(exact=True, num_workers=3, batch_size=8)
    assert err.value.key == "trainer.micro_batch_size"
    assert "null (exact mode's default for it: 3)" in str(err.value)
    assert "on 3 workers" in err.value.rule and "a divisor of 8" in err.value.rule
    assert TrainerConfig(exact=True, num_workers=3, batch_size=8, micro_batch_size=4)
