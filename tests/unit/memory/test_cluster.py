"""The memory tier's holders on a cluster: named by the run (never a path), released by a driver
that ends and, when no driver claims them, after their orphan time. (Restoring through them:
tests/unit/worker/test_node_holders.py.)"""

from __future__ import annotations

import pytest

from ftjob.memory import Ring, RingRef, Snapshot, SnapshotHolder, digest_all, machine
from ftjob.memory.cluster import LocalHolders, holder_name, holder_namespace
from ftjob.memory.fence import Refused
from ftjob.memory.holder import PutAnswer
from ftjob.storage.identity import RunIdentity


def snapshot(step: int) -> Snapshot:
    return Snapshot.of(step, {"model.pt": bytes([step]) * 100, "state.json": b"{}"})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_holder_no_driver_claims_for_its_orphan_time_is_orphaned_and_releases_everything():
    clock = Clock()
    holder = SnapshotHolder(cap_bytes=2**20, keep=2, orphan_timeout_s=60.0, clock=clock)
    assert holder.channel(1000, machine()) is not None  # its ring: released too
    holder.put(snapshot(1))
    clock.now += 50
    assert not holder.orphaned()
    holder.claim()  # the driver (this one, or the run's next) is alive
    clock.now += 59
    assert not holder.orphaned()
    clock.now += 2
    assert holder.orphaned()
    holder.release()
    assert holder.steps() == [] and holder.ring is None and holder.held_bytes() == 0
    # Without an orphan time (a holder owned by its driver) it never is.
    assert not SnapshotHolder(cap_bytes=2**20, keep=2, clock=clock).orphaned()


def test_a_holder_that_outlived_its_driver_takes_a_resumed_runs_settings() -> None:
    """A holder is made once per node and run: a resumed run that asks for other
    checkpoint.memory settings tells the one the last driver left, which takes them -- what it
    holds beyond them goes, oldest first; its ring, made for the old ones, is kept for the
    restore and made again for the first writer; the new orphan time counts from now."""
    clock = Clock()
    holder = SnapshotHolder(cap_bytes=2**20, keep=3, orphan_timeout_s=60.0, clock=clock)
    ring = Ring.attach(holder.channel(1000, machine(), 1))
    assert ring is not None
    slot, payload = ring.claim(1)
    files = {"model.pt#tensors": payload[:8]}
    ring.commit(slot, 9, {"model.pt#tensors": (0, 8, True)}, digest_all(files), 1)
    for step in (6, 7, 8):
        assert holder.put(snapshot(step), 1).kept
    assert holder.fence(2) is None  # the resumed run's driver, before its workers start

    before = holder.configure(2**19, 1, 10.0, generation=2)
    assert before == {"max_mb": 1.0, "keep": 3, "orphan_timeout_s": 60.0}
    assert holder.stats()["max_mb"] == 0.5 and holder.stats()["keep"] == 1
    assert sorted(holder.snapshots) == [8] and holder.steps(2) == [9, 8]  # the newest kept
    assert isinstance(holder.get(9, 2), RingRef)  # the restore still reads the old ring
    address = holder.channel(1000, machine(), 2)  # the first writer: a ring of 2 slots
    assert address is not None and address["token"] != ring.address["token"]
    assert holder.ring is not None and holder.ring.slots == 2
    assert holder.ring.nbytes <= 2**19
    clock.now += 11
    assert holder.orphaned()  # ten seconds now, not sixty
    assert holder.configure(2**19, 1, 10.0, generation=2) is None  # the same: nothing said
    refused = holder.configure(2**20, 3, 60.0, generation=1)  # a deposed driver's
    assert isinstance(refused, Refused) and holder.stats()["keep"] == 1


def test_a_step_already_held_keeps_its_first_copy():
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    first = snapshot(3)
    holder.put(first)
    other = Snapshot.of(3, {"model.pt": b"\x00" * 100, "state.json": b"{}"})
    assert holder.put(other) == PutAnswer(True)
    assert holder.get(3).digests == first.digests and holder.stats()["taken"] == 1


@pytest.mark.parametrize("name", ["../up", ".hidden", "a/b", "a*", "", "a b", "a@0123456789abcdef"])
def test_holders_are_named_by_a_valid_run_name_and_its_storages_key_only(name: str):
    key = "0123456789abcdef"
    with pytest.raises(ValueError, match="run name"):
        holder_namespace(RunIdentity(name, key))
    with pytest.raises(ValueError, match="run key"):
        RunIdentity("exp", "../x")
    with pytest.raises(ValueError, match="node id"):
        holder_name("../x")
    run = RunIdentity("digits_ft-2026.12.04", key)
    assert holder_namespace(run) == "ftjob.digits_ft-2026.12.04@0123456789abcdef"
    assert holder_name("ab12cd") == "holder.ab12cd"


def test_a_node_without_a_holder_gets_one_and_peers_are_the_others():
    made: list[SnapshotHolder] = []

    def make() -> SnapshotHolder:
        made.append(SnapshotHolder(cap_bytes=100, keep=1))
        return made[-1]

    directory = LocalHolders({"b": "holder-b", "a": "holder-a"}, make)
    assert directory.local("c") is made[0] and directory.local("c") is made[0]
    assert directory.peers("c") == [("a", "holder-a"), ("b", "holder-b")]
    directory.lose("a")
    assert [node for node, _ in directory.peers("b")] == ["c"]
    assert LocalHolders({}).local("x") is None  # no way to make one: none


@pytest.mark.ray
def test_on_ray_a_driver_fences_the_runs_holders_and_one_that_refused_it_is_dropped_or_stops_it():
    """The driver's side on embedded Ray: its fence reaches every holder of the run; a holder
    that knows a newer generation refuses it, and then the driver's lease decides -- lost: the
    run stops before its workers start; still its own: that holder is released. At its end a
    driver releases no holder that a newer driver fenced."""
    import ray

    from ftjob.config import MemoryConfig
    from ftjob.memory.cluster import RunHolders
    from ftjob.memory.lifecycle import held_snapshots
    from ftjob.storage.lease import LeaseLost

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        config = MemoryConfig(enabled=True, max_mb=16)
        run = RunIdentity("fence-run", "0123456789abcdef")
        holders = RunHolders(run, 2**24, 2, 60.0)
        holders.start([node])
        assert holders.fence(3).refused == {} and holders.fence(3).released == {}
        outcome = holders.fence(2)  # a driver of an older generation: deposed
        assert "fenced by lease generation 3" in outcome.refused[node]
        assert list(holders.held()) == [node]  # a refusal alone releases nothing

        def lost() -> None:
            raise LeaseLost("the run's lease is held by generation 3")

        said: list[str] = []
        with pytest.raises(LeaseLost):
            with held_snapshots(run, config, True, said.append, 2, lost):
                pass
        assert list(holders.held()) == [node]  # the newer driver's holder is left alone
        # The same refusal with the lease still this driver's: that holder is released; the
        # node's next holder is a new one, empty, fenced by this driver's ranks' first call.
        with held_snapshots(run, config, True, said.append, 2) as running:
            assert running is not None and holders.held() == {}
            fresh = running.local(node)
            assert ray.get(fresh.steps.remote(2)) == []
            assert ray.get(fresh.stats.remote())["generation"] == 2
            assert holders.release(generation=1) == 0  # fenced by a newer driver: kept
        assert any("refused this driver's fence" in line for line in said), said
        assert holders.held() == {}  # the run's end released it
    finally:
        ray.shutdown()
