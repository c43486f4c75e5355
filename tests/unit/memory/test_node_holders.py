"""The memory tier with a holder on every node (:mod:`ftjob.memory.cluster`): each
node's local rank 0 writes into its own node's ring, and a restore reads the nearest verified
copy -- its own node's, else a surviving peer's, which then fills its own node's holder. Holders
are plain objects here (one process stands for every node); a run on a Ray cluster that loses
rank 0's node: tests/e2e/test_elastic_run.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ftjob import metrics as M
from ftjob.actors import DirectHandle
from ftjob.config import MemoryConfig
from ftjob.memory import Ring, SnapshotHolder
from ftjob.memory.cluster import LocalHolders, RunHolders
from ftjob.memory.node_holders import NodeHolders, holders_for, merge_per_rank, split_per_rank
from ftjob.memory.tier import MemoryTier
from ftjob.memory.traffic import HolderTraffic, RunTraffic
from ftjob.record import Holder, WorkerPlace
from ftjob.storage.identity import RunIdentity
from ftjob.worker.checkpointer import (
    MODEL_FILE,
    STATE_FILE,
    TrainState,
    load_state,
    snapshot_state,
    snapshot_tensors,
)
from tests.unit.worker.test_checkpointer import make, model_and_optimizer, weights


def cluster(*nodes: str) -> tuple[LocalHolders, dict[str, SnapshotHolder]]:
    """A holder on each of ``nodes``, in one directory; the holders themselves, by node."""
    held = {node: SnapshotHolder(cap_bytes=2**24, keep=2) for node in nodes}
    return LocalHolders({n: DirectHandle(h) for n, h in held.items()}), held


def tier(directory: LocalHolders, node: str, rank: int, lines: list[str] | None = None) -> Any:
    """Rank ``rank``'s memory tier on ``node``, where it is the local rank 0 (it writes)."""
    lines = [] if lines is None else lines
    config = MemoryConfig(enabled=True, max_mb=64.0)
    place = NodeHolders(directory, node, writes=True)
    return MemoryTier(place, config, rank, M.MetricSet(), lambda v: v, lines.append)


def snap(memory: MemoryTier, step: int, model: Any, optimizer: Any, rank: int) -> None:
    """The snapshot of ``step`` as this rank's node writes it (its own metrics and time)."""
    state = TrainState(
        step=step, position=32 * step, global_batch_size=32, metrics={"rank": rank}, time=rank
    )
    memory.take(step, snapshot_tensors(model, optimizer), lambda: {STATE_FILE: state.to_json()})
    memory.wait()


def with_buffers(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 4)).sum().backward()  # a step: the optimizer has its state
    optimizer.step()
    return model, optimizer


def rank_view(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` as rank ``rank`` has it after a step: DDP keeps the weights the same on every
    rank, each rank's BatchNorm statistics come from its own slice of the batch."""
    view = copy.deepcopy(model)
    view[1].running_mean += rank
    return view


def test_each_node_writes_its_own_ring_and_rank_0s_nodes_loss_leaves_a_whole_copy() -> None:
    directory, held = cluster("node0", "node1")
    model, optimizer = with_buffers(0)
    writers = [tier(directory, f"node{rank}", rank) for rank in (0, 1)]
    for step in (1, 2, 3):
        for rank, memory in enumerate(writers):
            snap(memory, step, rank_view(model, rank), optimizer, rank)
    # Each node's copy is in its own ring: nothing was sent to a holder but rank 0's own part
    # (its buffers and records: small) to its peer.
    for node in ("node0", "node1"):
        assert held[node].steps() == [3, 2] and held[node].snapshots == {}
    rings = [memory.ring for memory in writers]
    assert all(isinstance(r, Ring) for r in rings) and rings[0].address != rings[1].address
    assert sorted(held["node1"].parts) == [1, 2, 3] and held["node0"].parts == {}
    part = held["node1"].parts[3]
    assert part.nbytes < 2048 and all("#buffers" in n or "#rank" in n for n in part.files)

    directory.lose("node0")  # rank 0's node, and its holder, are gone
    survivor = tier(directory, "node1", 0)  # the group restarts on node1: rank 0 there
    choice = survivor.offer(lambda: [])
    assert choice is not None and (choice.step, choice.node) == (3, "node1")
    assert survivor.source == Holder.local
    files = survivor.files(choice)
    state = json.loads(files[STATE_FILE])
    assert (state["step"], state["position"], state["metrics"]) == (3, 96, {"rank": 0})
    # Loaded, it is rank 0's state bit for bit: its weights, and its buffers, not node1's.
    fresh, fresh_optimizer = with_buffers(1)
    load_state(snapshot_state(files, torch.device("cpu")), fresh, fresh_optimizer)
    expected = model.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in fresh.state_dict().items())


def test_the_holders_count_what_reached_them_in_place_and_through_calls() -> None:
    # Three nodes, one writer each: every snapshot is written in place on each node; through
    # calls came only rank 0's part, to each of its two peers -- the bytes that cross nodes.
    directory, held = cluster("node0", "node1", "node2")
    model, optimizer = with_buffers(0)
    writers = [tier(directory, f"node{rank}", rank) for rank in (0, 1, 2)]
    for step in (1, 2, 3, 4):
        for rank, memory in enumerate(writers):
            snap(memory, step, rank_view(model, rank), optimizer, rank)
    counts = {node: holder.traffic() for node, holder in held.items()}
    size = held["node0"].ring.read(4).nbytes
    assert counts["node0"] == HolderTraffic(in_place=4, in_place_bytes=4 * size)
    part = held["node1"].parts[4].nbytes
    for peer in ("node1", "node2"):
        assert (counts[peer].parts, counts[peer].part_bytes) == (4, 4 * part)
        assert counts[peer].in_place == 4 and counts[peer].sent == 0
    traffic = RunTraffic.of(list(counts.values()))
    assert (traffic.snapshots, traffic.snapshot_bytes) == (4, size)
    assert traffic.between_nodes_per_snapshot == 2 * part and traffic.part_bytes == part
    assert 0 < part < size
    # A whole snapshot sent (a writer elsewhere; a peer's copy after a restore) is counted.
    held["node2"].put(held["node0"].ring.read(4).own())
    assert held["node2"].traffic().sent_bytes == size
    assert f"between nodes {2 * part} B per snapshot" in traffic.line()


def test_a_step_rank_0_did_not_take_is_passed_over_for_the_newest_it_did() -> None:
    # Rank 0 failed after step 15 was trained, before its snapshot; rank 1 took it: without
    # rank 0's part it is not the run's state (rank 1's buffers), so 14 is restored.
    directory, held = cluster("node0", "node1")
    model, optimizer = with_buffers(0)
    snap(tier(directory, "node0", 0), 14, model, optimizer, 0)
    rank1 = tier(directory, "node1", 1)
    for step in (14, 15):
        snap(rank1, step, rank_view(model, 1), optimizer, 1)
    choice = tier(directory, "node1", 0).offer(lambda: [])
    assert choice is not None and choice.step == 14


def test_a_rank_whose_node_holds_no_copy_reads_rank_0s_from_its_peer_once_and_keeps_it() -> None:
    directory, held = cluster("node0", "node1")
    model, optimizer = model_and_optimizer(0)
    snap(tier(directory, "node0", 0), 4, model, optimizer, 0)  # node1 was replaced: empty
    rank0, rank1 = tier(directory, "node0", 0), tier(directory, "node1", 1)
    choice = rank0.offer(lambda: [(0, 2)])
    assert choice is not None and choice.node == "node0" and rank0.source == Holder.local
    files = rank1.files(choice)
    assert rank1.source == Holder.peer and rank1.reader.node_read == "node0"
    assert json.loads(files[STATE_FILE])["metrics"] == {"rank": 0}  # rank 0's copy, whole
    assert held["node1"].steps() == [4]  # filled from the peer: the next restore reads it here
    again = tier(directory, "node1", 1)
    again.files(choice)
    assert again.source == Holder.local


def test_a_copy_that_does_not_verify_here_is_dropped_and_a_peers_is_read(tmp_path: Path) -> None:
    directory, held = cluster("node0", "node1")
    model, optimizer = model_and_optimizer(0)
    for rank in (0, 1):
        snap(tier(directory, f"node{rank}", rank), 5, model, optimizer, rank)
    held["node1"].ring.read(5).files[f"{MODEL_FILE}#tensors"][0] ^= 0x01  # a bit flipped
    lines: list[str] = []
    rank0, rank1 = tier(directory, "node0", 0), tier(directory, "node1", 1, lines)
    choice = rank0.offer(lambda: [])
    assert choice is not None
    rank1.files(choice)
    assert rank1.source == Holder.peer
    assert any("memory snapshot of step 5 is not usable" in line for line in lines), lines
    assert held["node1"].steps() == [5]  # the bad copy dropped, rank 0's kept in its place
    assert held["node1"].get(5).digests == dict(choice.digests)


def test_rank_0_on_a_new_node_restores_a_peers_snapshot_and_says_so(tmp_path: Path) -> None:
    directory, held = cluster("node1", "node2")  # node2: a replacement, its holder empty
    model, optimizer = model_and_optimizer(0)
    for step in (7, 8):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        snap(tier(directory, "node1", 0), step, model, optimizer, 0)
    place = NodeHolders(directory, "node2", writes=True)
    checkpointer, _ = make(tmp_path, holder=place)
    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = checkpointer.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.state.step == 8
    record = restored.record(0.0)
    assert (record.tier.value, record.holder) == ("memory", Holder.peer)
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(model), strict=True))
    assert held["node2"].steps() == [8]
    # Past the restored step nothing is offered again, on any node (the lost attempt's).
    checkpointer.memory.restored(7)
    assert held["node1"].steps() == [7] and held["node2"].steps() == []


def test_a_deposed_drivers_workers_are_refused_and_the_live_run_restores_what_came_before():
    # Ranks 0 and 1 of a driver of lease generation 1 outlive it; the next driver (generation
    # 2) fences the holders before its workers start. Snapshots of step 4 were written before
    # that: the live run restores them. Step 5, written after it, is refused on either path
    # (node0's ring, node1's through a call), said, and the writers stop taking snapshots.
    directory, held = cluster("node0", "node1")
    model, optimizer = with_buffers(0)
    config = MemoryConfig(enabled=True, max_mb=64.0)
    lines: list[str] = []
    zombies = [
        MemoryTier(
            NodeHolders(directory, f"node{r}", True, 1),
            config,
            r,
            M.MetricSet(),
            lambda v: v,
            lines.append,
        )
        for r in (0, 1)
    ]
    snap(zombies[0], 4, model, optimizer, 0)  # rank 1 had not written yet
    for holder in held.values():
        assert holder.fence(2) is None
    for rank, zombie in enumerate(zombies):
        snap(zombie, 5, rank_view(model, rank), optimizer, rank)
        assert zombie.fenced is not None and "fenced by lease generation 2" in zombie.fenced
        assert not zombie.enabled and not zombie.due(6)
    assert sum("memory tier off for this worker" in line for line in lines) == 2, lines
    assert held["node0"].steps() == [4] and held["node1"].steps() == []
    # Rank 0's part of step 5 is never sent: its own node's holder refused it first.
    assert sorted(held["node1"].parts) == [4]
    assert held["node1"].stats()["refused"] == 2  # node1's ring, its sent snapshot

    live = MemoryTier(
        NodeHolders(directory, "node1", True, 2),
        config,
        0,
        M.MetricSet(),
        lambda v: v,
        lines.append,
    )
    choice = live.offer(lambda: [])
    assert choice is not None and (choice.step, choice.node) == (4, "node0")
    assert json.loads(live.files(choice)[STATE_FILE])["step"] == 4
    live.restored(4)
    snap(live, 5, model, optimizer, 0)  # the live run's own step 5 lands
    assert live.fenced is None and held["node1"].steps() == [5, 4]


def test_a_resumed_runs_writer_lets_go_of_the_ring_its_holder_made_again_for_new_settings():
    """A resumed run asks for other checkpoint.memory settings: the holder that outlived the
    last driver takes them, keeps its ring until the restore has read it, then makes it again
    in the new shape for the first writer -- which lets go of its mapping of the old one: kept,
    that memory would stay taken beside the new ring's."""
    directory, held = cluster("node0")
    holder = held["node0"]
    model, optimizer = model_and_optimizer(0)
    snap(tier(directory, "node0", 0), 4, model, optimizer, 0)  # the last driver's worker
    old = holder.ring
    assert old is not None and old.slots == 3
    assert holder.configure(2**24, 3, 60.0) == {"max_mb": 16.0, "keep": 2, "orphan_timeout_s": 0}
    resumed = tier(directory, "node0", 0)  # the resumed run's worker
    choice = resumed.offer(lambda: [])
    assert choice is not None and choice.step == 4  # read from the ring made for the last run
    assert json.loads(resumed.files(choice)[STATE_FILE])["step"] == 4
    (mapped,) = resumed.writer._rings.values()
    snap(resumed, 5, model, optimizer, 0)
    assert holder.ring is not old and holder.ring is not None and holder.ring.slots == 4
    assert mapped is not None and mapped.memory.closed
    assert list(resumed.writer._rings.values()) == [resumed.ring]
    assert holder.steps() == [5]


def writer(holder: SnapshotHolder, keep: int, lines: list[str]) -> MemoryTier:
    """Rank 0 of a driver of lease generation 1, writing into ``holder`` with
    ``checkpoint.memory.keep=keep``."""
    place = NodeHolders(LocalHolders({"node0": DirectHandle(holder)}), "node0", True, 1)
    config = MemoryConfig(enabled=True, max_mb=64.0, keep=keep)
    return MemoryTier(place, config, 0, M.MetricSet(), lambda v: v, lines.append)


def test_a_full_ring_takes_every_snapshot_in_its_oldests_place() -> None:
    # A holder that outlived its driver made its ring for keep=1 (two slots); the resumed run
    # keeps 2. Then a writer killed between a commit and its pruning leaves every slot
    # committed. Neither fails a snapshot (the attempt would fail with it, every attempt).
    model, optimizer = with_buffers(0)
    lines: list[str] = []
    holder = SnapshotHolder(cap_bytes=2**24, keep=1)
    memory = writer(holder, 2, lines)
    for step in range(1, 6):
        snap(memory, step, model, optimizer, 0)
        assert memory.enabled and holder.steps(1) == [step, step - 1][: min(step, 2)]
    holder = SnapshotHolder(cap_bytes=2**24, keep=2)
    memory = writer(holder, 2, lines)
    for step in (1, 2):
        snap(memory, step, model, optimizer, 0)
    memory.ring.keep_newest = lambda *args: []  # SIGKILL right after the commit of step 3
    snap(memory, 3, model, optimizer, 0)
    assert sorted(holder.ring.committed()) == [1, 2, 3]
    restarted = writer(holder, 2, lines)  # the next attempt's rank 0
    choice = restarted.offer(lambda: [])
    assert choice is not None and choice.step == 3
    restarted.files(choice)
    restarted.restored(3)
    snap(restarted, 4, model, optimizer, 0)
    assert restarted.enabled and holder.steps(1) == [4, 3], lines
    assert not any("off" in line for line in lines), lines


def test_a_snapshot_with_no_slot_to_take_is_skipped_and_said_once() -> None:
    # Another live writer holds the ring's other slot (a previous attempt's rank 0, frozen
    # mid-write): the newest snapshot is kept, the next ones are skipped -- training goes on
    # -- until a slot is free again.
    model, optimizer = with_buffers(0)
    lines: list[str] = []
    holder = SnapshotHolder(cap_bytes=2**24, keep=1)
    memory = writer(holder, 1, lines)
    snap(memory, 1, model, optimizer, 0)
    frozen = Ring.attach(holder.ring.address)
    slot, _ = frozen.claim(1)
    snap(memory, 2, model, optimizer, 0)
    snap(memory, 3, model, optimizer, 0)
    assert holder.steps(1) == [1] and memory.enabled and memory.skipped == 2
    assert sum("snapshot of step 2 is skipped" in line for line in lines) == 1, lines
    assert not any("step 3" in line for line in lines), lines
    frozen.release(slot)
    snap(memory, 4, model, optimizer, 0)
    assert holder.steps(1) == [4] and memory.busy is None


def test_per_rank_keys_travel_apart_and_come_back_whole() -> None:
    records = {STATE_FILE: {"step": 3, "metrics": {"a": 1}, "time": 2.0}, "config.json": {"x": 1}}
    split = split_per_rank(records, writer=2)
    assert split[STATE_FILE] == {"step": 3}
    assert split[f"{STATE_FILE}#rank"] == {"metrics": {"a": 1}, "time": 2.0, "writer": 2}
    files = {name: json.dumps(record).encode() for name, record in split.items()}
    merged = merge_per_rank(files)
    assert set(merged) == {STATE_FILE, "config.json"}
    assert json.loads(merged[STATE_FILE]) == records[STATE_FILE]


def test_on_ray_the_first_rank_of_each_node_writes_there_whoever_asks_first() -> None:
    # Ranks 0..3 on nodes b, a, b, a, every one at one IP address (a simulated cluster: Ray
    # Train's local ranks 0..3): rank 0 writes node b's snapshots -- and sends its own part to
    # a's holder with each one -- rank 1 node a's; ranks 2 and 3 write none.
    nodes = ["b", "a", "b", "a"]
    run = RunHolders(RunIdentity("r", "0" * 16), cap_bytes=2**20, keep=2, orphan_timeout_s=60.0)
    writes = []
    for rank, node in enumerate(nodes):
        ctx = SimpleNamespace(
            rank=rank,
            local_rank=rank,
            where=WorkerPlace(node, pid=100 + rank),
            all_gather=lambda node_id, nodes=nodes: list(nodes),
        )
        bound = holders_for(run, ctx)
        assert bound.node == node
        writes.append(bound.writes)
    assert writes == [True, True, False, False]
