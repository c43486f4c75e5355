"""The driver's side of the memory tier's holders: the key that bounds how long they outlive a
driver, the claims that keep them while it lives, and that they are the run's by its name and
storage, not its name alone. (The holders themselves:
tests/unit/storage/test_memory_cluster.py; a run on Ray: tests/e2e/test_elastic_run.py.)"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

import pytest
import torch

from ftjob.config import ConfigError, MemoryConfig, RetryConfig
from ftjob.memory.lifecycle import claim_interval, held_snapshots
from ftjob.storage.fs import build_filesystem
from ftjob.storage.identity import RunIdentity, run_identity
from ftjob.worker.checkpointer import STATE_FILE, TrainState


def test_the_orphan_time_is_a_checked_key_and_the_driver_claims_well_within_it():
    with pytest.raises(ConfigError, match="orphan_timeout_s"):
        MemoryConfig(orphan_timeout_s=0)
    assert claim_interval(300.0) == 30.0 and claim_interval(8.0) == 2.0
    assert claim_interval(0.1) <= 0.1 / 4  # several claims within even a short orphan time
    run = RunIdentity("run", "0" * 16)
    with held_snapshots(run, MemoryConfig(enabled=False), False, print) as holders:
        assert holders is None  # the tier off: no holder anywhere, nothing to release


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its optimizer after a step (AdamW: it has state)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.ray
def test_two_runs_of_one_name_with_their_own_storage_never_share_their_holders(tmp_path: Path):
    """Runs called ``exp`` with storage of their own on one Ray cluster (sweep jobs given
    ``name=``, two users' ``baseline``): the second one's start leaves the first one's holders
    alone, and the first one's next restore reads its own weights, never the second's."""
    import ray

    from ftjob import metrics as M
    from ftjob.memory.node_holders import NodeHolders
    from ftjob.memory.tier import MemoryTier
    from ftjob.worker.checkpointer import load_state, snapshot_state, snapshot_tensors

    runs = {}
    for who in ("a", "b"):
        fs, root = build_filesystem(str(tmp_path / who), {}, RetryConfig(max_attempts=1))
        runs[who] = run_identity(fs, posixpath.join(root, "exp"), "exp")
    assert runs["a"].name == runs["b"].name and runs["a"].key != runs["b"].key
    memory, said = MemoryConfig(enabled=True, max_mb=64.0, keep=2), []
    model, optimizer = trained()

    def tier(holders: Any, node: str) -> MemoryTier:
        place = NodeHolders(holders, node, True, 1)
        return MemoryTier(place, memory, 0, M.MetricSet(), ray.get, said.append)

    def take(memory_tier: MemoryTier, step: int, value: float) -> None:
        with torch.no_grad():
            model.weight.fill_(value)
        state = TrainState(step=step, position=8 * step, global_batch_size=8)
        memory_tier.take(
            step, snapshot_tensors(model, optimizer), lambda: {STATE_FILE: state.to_json()}
        )
        memory_tier.wait(30)

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        with held_snapshots(runs["a"], memory, False, said.append, 1) as holders_a:
            writer_a = tier(holders_a, node)
            for step in (1, 2, 3):
                take(writer_a, step, 1.0)
            with held_snapshots(runs["b"], memory, False, said.append, 1) as holders_b:
                assert list(holders_a.held()) == [node]  # B's start released none of A's
                writer_b = tier(holders_b, node)
                for step in range(1, 9):
                    take(writer_b, step, 2.0)
                restart_a = tier(holders_a, node)  # A's worker failed: its next attempt
                chosen = restart_a.offer(lambda: [(1, 2)])
                assert chosen is not None and chosen.step == 3, said
                restored, its_optimizer = trained()
                load_state(snapshot_state(restart_a.files(chosen), "cpu"), restored, its_optimizer)
                assert torch.equal(restored.weight, torch.full((2, 4), 1.0))
            assert list(holders_a.held()) == [node]  # B's end released none of A's either
        assert not any("outlived its last driver" in line for line in said), said
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_a_resumed_run_gives_the_holders_that_outlived_its_last_driver_its_settings():
    """A holder is made once per node and run: the one the last driver left on a cluster that
    lived on keeps what it was made with until the resumed run's driver tells it otherwise --
    after its fence -- saying once what changed."""
    import ray

    from ftjob.memory.cluster import RunHolders

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        run = RunIdentity("retuned-run", "0123456789abcdef")
        RunHolders(run, 2**24, 2, 60.0).start([node])  # the last driver's, left behind
        config = MemoryConfig(enabled=True, max_mb=8.0, keep=3, orphan_timeout_s=120.0)
        said: list[str] = []
        with held_snapshots(run, config, True, said.append, 2) as holders:
            assert holders is not None
            stats = ray.get(holders.held()[node].stats.remote())
            assert (stats["max_mb"], stats["keep"], stats["orphan_timeout_s"]) == (8, 3, 120)
            assert stats["generation"] == 2
        retuned = [line for line in said if "settings" in line]
        assert retuned == [
            "memory tier: 1 snapshot holder(s) that outlived the last driver take this run's "
            "checkpoint.memory settings (max_mb 16 -> 8, keep 2 -> 3, orphan_timeout_s 60 -> 120)"
        ], said
    finally:
        ray.shutdown()
