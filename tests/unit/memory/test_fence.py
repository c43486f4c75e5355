"""The memory tier's fence (:mod:`ftjob.memory.fence`): a holder fenced by the run's
lease generation refuses a deposed driver's workers' writes and never offers them to a restore,
while what the dead driver's workers wrote before the takeover stays restorable. Plain holders
with their real shared-memory rings; the tier's side of a refusal:
tests/unit/worker/test_node_holders.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftjob.memory import Ring, RingRef, Snapshot, SnapshotHolder, digest_all, machine
from ftjob.memory.fence import Refused

HERE = machine()
ROOT = Path(__file__).resolve().parents[3]


def snapshot(step: int) -> Snapshot:
    return Snapshot.of(step, {"model.pt": bytes([step]) * 100, "state.json": b"{}"})


def write(ring: Ring, step: int, generation: int | None, keep: int | None = None) -> None:
    """A snapshot of ``step`` into ``ring`` as a rank of lease ``generation`` writes it; with
    ``keep``, its pruning as a writer's (of its generation's), else the newest 4 of any."""
    slot, payload = ring.claim(generation)
    payload[:8] = step
    files = {"model.pt#tensors": payload[:8]}
    ring.commit(slot, step, {"model.pt#tensors": (0, 8, True)}, digest_all(files), generation)
    if keep is None:
        ring.keep_newest(4)
    else:
        ring.keep_newest(keep, generation)


def test_a_stale_generations_writes_are_refused_and_a_restore_reads_only_fenced_snapshots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holder = SnapshotHolder(cap_bytes=2**20, keep=4)
    dead = Ring.attach(holder.channel(4096, HERE, 1))  # the dead driver's rank: generation 1
    write(dead, 10, 1)
    assert holder.put(snapshot(11), 1).kept

    assert holder.fence(2) is None  # the next driver took the run, before its workers start
    assert holder.steps() == [11, 10]  # committed before the takeover: still restorable

    # The dead driver's worker lives on: every write of generation 1 is refused, saying why.
    answer = holder.put(snapshot(13), 1)
    assert answer.kept is False and answer.fenced is True
    assert "lease generation 1" in answer.reason and "fenced by lease generation 2" in (
        answer.reason
    )
    assert isinstance(holder.put_part(snapshot(13), 1), Refused)
    assert isinstance(holder.drop_after(0, 1), Refused) and holder.steps() == [11, 10]
    with pytest.raises(Ring.Fenced, match="fenced by lease generation 2.*held generation 1"):
        dead.claim(1)
    # One that slipped past both checks (its commit raced the fence) is held, never offered.
    monkeypatch.setattr(dead, "check_fence", lambda generation: None)
    write(dead, 14, 1)
    assert 14 in holder.ring.committed() and holder.get(14) is None and 14 not in holder.steps()

    live = Ring.attach(holder.channel(4096, HERE, 2))
    write(live, 12, 2)
    assert holder.put(snapshot(12), 2).kept  # a peer's copy of the same step: kept as is
    assert holder.steps() == [12, 11, 10]  # the newest a restore offers: the live run's
    ref = holder.get(12)
    assert isinstance(ref, RingRef) and live.read(12, ref.nonce).verify() is None
    assert holder.stats()["refused"] == 3 and holder.stats()["generation"] == 2
    assert holder.traffic().refused == 3
    # The live run's restore drops the steps after its own, the zombie's unlisted one too.
    assert holder.drop_after(12, 2) == [14] and 14 not in holder.ring.committed()
    # One that slips in later is emptied by the live writer's next commit: its step never
    # counts as the ring's newest (nor does the dead driver's 10, older than the live run's).
    write(dead, 15, 1)
    assert live.keep_newest(4, 2) == [] and set(holder.ring.committed()) == {12}


def test_a_commit_whose_holder_was_fenced_after_its_claim_is_refused_and_its_slot_emptied():
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    ring = Ring.attach(holder.channel(4096, HERE, 1))
    slot, payload = ring.claim(1)
    holder.fence(2)
    files = {"model.pt#tensors": payload[:8]}
    with pytest.raises(Ring.Fenced):
        ring.commit(slot, 5, {"model.pt#tensors": (0, 8, True)}, digest_all(files), 1)
    assert ring.committed() == {} and ring.claim(2)[0] == slot


def test_what_has_no_known_generation_is_never_offered_once_a_driver_fences_the_holder():
    # A holder's state from before generations (a write without one): fail safe, not offered.
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    write(Ring.attach(holder.channel(4096, HERE)), 3, None)
    holder.put(snapshot(4))
    assert holder.steps() == [4, 3]  # no fence (a run without a lease): everything, as before
    holder.fence(5)
    assert holder.steps() == [] and holder.snapshots == {}
    assert not holder.put(snapshot(6)).kept  # nor is a write without a generation taken
    # A driver of an older generation than the holder knows is deposed: its fence is refused.
    assert "fenced by lease generation 5" in holder.fence(4).reason
    assert holder.fence(5) is None and holder.fence(6) is None


def test_a_newer_writer_moves_the_fence_on_but_admits_nothing_older():
    # A holder no driver fenced (a rank created it on a node that joined later): a deposed
    # driver's worker wrote first; the live run's first write fences it, and that write is
    # never offered beside the live run's.
    holder = SnapshotHolder(cap_bytes=2**20, keep=4)
    holder.put(snapshot(9), 1)
    write(Ring.attach(holder.channel(4096, HERE, 1)), 8, 1)
    assert holder.put(snapshot(5), 2).kept
    assert holder.steps() == [5] and holder.stats()["generation"] == 2
    assert holder.ring.committed() == {}  # the ring's slot of step 8 emptied, not just hidden
    assert not holder.put(snapshot(10), 1).kept


def test_a_newer_reader_moves_the_fence_on_and_is_offered_nothing_a_deposed_worker_wrote():
    # A holder no driver fenced, written only by a deposed driver's worker (generation 1): the
    # live run's rank 0 (generation 2) reads it before any of its ranks wrote there.
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    holder.put(snapshot(9), 1)
    holder.put_part(snapshot(9), 1)
    write(Ring.attach(holder.channel(4096, HERE, 1)), 12, 1)
    assert holder.steps() == [12, 9]  # a reader that claims no generation: what is admitted
    assert holder.steps(2) == []
    assert holder.get(12, 2) is None and holder.get(9, 2) is None
    assert holder.part(9, 2) is None and holder.copy(12, 2) is None
    # The stale slot is emptied: kept, its later step would stay "the newest" in the ring and
    # evict the live writer's snapshots (Ring.keep_newest).
    assert holder.ring.committed() == {}
    assert holder.steps(1) == [] and holder.stats()["refused"] == 0  # a read: not a write
    live = Ring.attach(holder.channel(4096, HERE, 2))
    for step in (3, 4, 5):
        write(live, step, 2)
        live.keep_newest(2)
    assert holder.steps(2) == [5, 4]


def claim_and_die(address: dict[str, Any]) -> int:
    """A writer in a process of its own that claims a slot and is killed writing it: the
    slot."""
    dies = subprocess.run(
        [sys.executable, "-c", DIES, json.dumps(address)], cwd=ROOT, capture_output=True, text=True
    )
    assert dies.returncode == -9, dies.stderr
    return int(dies.stdout)


DIES = """
import json, os, sys
from ftjob.memory import Ring
slot, payload = Ring.attach(json.loads(sys.argv[1])).claim(2)  # the live run's
payload[:8] = 99
print(slot, flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_slot_a_live_writer_claimed_is_never_taken_and_one_whose_writer_died_is():
    # A deposed driver's worker claimed a slot just before the fence and was frozen there
    # (SIGSTOP, a paused VM): it lives, so its slot stays its own however long it sleeps; a
    # slot whose writer was killed mid-write is taken back.
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)  # three slots
    frozen = Ring.attach(holder.channel(4096, HERE, 1))
    half, _ = frozen.claim(1)
    holder.fence(2)
    live = Ring.attach(holder.channel(4096, HERE, 2))
    write(live, 7, 2)
    dead = claim_and_die(holder.ring.address)
    assert dead not in (half, holder.ring.committed()[7])
    slot, _ = live.claim(2)
    assert slot == dead and slot != half
    live.release(slot)
    write(live, 8, 2)  # no slot is empty now: the frozen writer's and two snapshots
    other = Ring.attach(holder.ring.address)  # another writer of the live run
    oldest, _ = other.claim(2)  # frees the oldest snapshot, never the frozen writer's slot
    assert oldest not in (half, holder.ring.committed()[8]) and holder.steps(2) == [8]
    with pytest.raises(Ring.Busy, match="newest snapshot is kept"):
        live.claim(2)  # the newest is never given up: this snapshot is skipped
    assert frozen.release(oldest) is False and other.release(oldest) is True  # its own only
    assert frozen.release(half) is True


def test_a_frozen_deposed_writer_never_writes_into_the_live_runs_slot_nor_empties_it():
    # Three slots, no empty one left: the live writer's next claim frees its oldest snapshot,
    # never the frozen writer's slot. When that writer thaws, its bytes land in its own slot
    # (the live run's digests describe the live run's bytes), and its commit, refused by the
    # fence, empties only its own claim.
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    zombie = Ring.attach(holder.channel(4096, HERE, 1))
    zombie_slot, zombie_payload = zombie.claim(1)
    assert holder.fence(2) is None
    live = Ring.attach(holder.channel(4096, HERE, 2))
    for step in (20, 21):
        write(live, step, 2, keep=2)
    slot, payload = live.claim(2)
    assert slot != zombie_slot and slot == holder.ring.committed().get(20, slot)
    payload[:8] = 22
    zombie_payload[:8] = 99  # the zombie thaws and copies its weights
    files = {"model.pt#tensors": payload[:8]}
    live.commit(slot, 22, {"model.pt#tensors": (0, 8, True)}, digest_all(files), 2)
    live.keep_newest(2, 2)
    ref = holder.get(22, 2)
    restored = live.read(22, ref.nonce)
    assert (
        restored.verify() is None and bytes(restored.files["model.pt#tensors"]) == bytes([22]) * 8
    )
    with pytest.raises(Ring.Fenced):
        zombie.commit(
            zombie_slot,
            30,
            {"model.pt#tensors": (0, 8, True)},
            digest_all({"model.pt#tensors": zombie_payload[:8]}),
            1,
        )
    assert holder.steps(2) == [22, 21]  # the live run's newest is still there
    assert zombie.keep_newest(1, 1) == [] and holder.steps(2) == [22, 21]  # nor does it prune


def test_a_full_ring_frees_its_oldest_snapshot_of_the_writers_generation_never_the_newest():
    # Every slot committed (a resumed run keeps more than the surviving holder's ring was
    # made for; a writer killed between its commit and its pruning): the next claim frees the
    # oldest snapshot, and the ring goes on holding the newest ones.
    holder = SnapshotHolder(cap_bytes=2**20, keep=1)  # two slots
    ring = Ring.attach(holder.channel(4096, HERE, 3))
    for step in (1, 2, 3, 4, 5):
        write(ring, step, 3, keep=2)  # more than the ring holds
        assert max(holder.steps(3)) == step
    assert holder.steps(3) == [5, 4]
    # A newer generation's snapshots are never freed by an older writer's claim (it is
    # fenced anyway), and the newest is never freed by anyone: with nothing else, refused.
    older = SnapshotHolder(cap_bytes=2**20, keep=1)
    newest = Ring.attach(older.channel(4096, HERE, 1))
    write(newest, 9, 1, keep=2)
    half, _ = Ring.attach(older.ring.address).claim(1)  # a live writer's claim
    with pytest.raises(Ring.Busy, match="newest snapshot is kept"):
        newest.claim(1)
    assert older.steps(1) == [9]


def test_the_holder_never_empties_a_slot_a_writer_is_claiming():
    holder = SnapshotHolder(cap_bytes=2**20, keep=1)
    ring = Ring.attach(holder.channel(4096, HERE, 1))
    write(ring, 4, 1)
    write(ring, 5, 1)
    entry = next(e for e in holder.ring.entries() if e.step == 4)
    slot, _ = ring.claim(1)  # takes the oldest snapshot's slot: step 4's
    assert slot == entry.slot
    assert holder.ring.discard(entry.slot, entry.nonce) is False  # that commit is gone
    assert holder.drop_after(4, 1) == [5] and holder.ring.committed() == {}
    ring.commit(slot, 6, {}, {}, 1)  # still this writer's claim
    assert holder.steps(1) == [6]
