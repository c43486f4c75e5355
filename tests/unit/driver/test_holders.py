"""The driver's side of the memory tier's holders: the key that bounds how long they outlive a
driver, and the claims that keep them while it lives. (The holders themselves:
tests/unit/storage/test_memory_cluster.py; a run on Ray: tests/e2e/test_elastic_run.py.)"""

from __future__ import annotations

import pytest

from ftjob.config import ConfigError, MemoryConfig
from ftjob.driver.holders import claim_interval, held_snapshots


def test_the_orphan_time_is_a_checked_key_and_the_driver_claims_well_within_it():
    with pytest.raises(ConfigError, match="orphan_timeout_s"):
        MemoryConfig(orphan_timeout_s=0)
    assert claim_interval(300.0) == 30.0 and claim_interval(8.0) == 2.0
    assert claim_interval(0.1) <= 0.1 / 4  # several claims within even a short orphan time
    with held_snapshots("run", MemoryConfig(enabled=False), False, print) as holders:
        assert holders is None  # the tier off: no holder anywhere, nothing to release
