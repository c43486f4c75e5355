"""The memory tier's holder: the newest snapshots within a count and a byte cap, verified by
digest. (Taking and restoring snapshots: test_checkpointer.py; a run restoring from them:
test_worker_local.py and the elastic run, test_chaos_e2e.py.)"""

from __future__ import annotations

from ftjob.storage.memory import Snapshot, SnapshotHolder


def snapshot(step: int, size: int = 100) -> Snapshot:
    return Snapshot.of(step, {"model.pt": bytes([step % 256]) * size, "state.json": b"{}"})


def test_the_holder_keeps_the_newest_snapshots_within_count_and_cap() -> None:
    holder = SnapshotHolder(cap_bytes=350, keep=3)
    for step in (1, 2, 3):
        assert holder.put(snapshot(step))["kept"]
    assert holder.steps() == [3, 2, 1]
    assert holder.put(snapshot(4)) == {"kept": True, "dropped": [1]}  # the count
    assert holder.put(snapshot(5, size=200)) == {"kept": True, "dropped": [2, 3]}  # the cap
    assert holder.steps() == [5, 4] and holder.held_bytes() <= 350
    assert holder.stats()["taken"] == 5 and holder.stats()["dropped"] == 3


def test_a_snapshot_bigger_than_the_cap_is_refused_and_nothing_held_is_dropped() -> None:
    holder = SnapshotHolder(cap_bytes=150, keep=2)
    holder.put(snapshot(1))
    answer = holder.put(snapshot(2, size=1000))
    assert not answer["kept"] and "does not fit" in answer["reason"]
    assert holder.steps() == [1]


def test_verification_names_the_file_that_does_not_match() -> None:
    good = snapshot(7)
    assert good.verify() is None
    files = dict(good.files, **{"model.pt": b"x" + good.files["model.pt"][1:]})
    assert Snapshot(7, files, good.digests).verify() == "model.pt does not match its sha256"
    missing = Snapshot(7, {"state.json": b"{}"}, good.digests).verify()
    assert missing is not None and "do not match" in missing
    holder = SnapshotHolder(cap_bytes=1000, keep=2)
    holder.put(good)
    holder.discard(7)
    assert holder.steps() == [] and holder.get(7) is None


def test_after_a_restore_the_lost_attempts_later_snapshots_are_dropped() -> None:
    # The attempt that died had held 11 and 12; the run restored 10 (storage): kept, 11 and 12
    # would be restored after the next failure instead of the new attempt's, and evicted
    # before them.
    holder = SnapshotHolder(cap_bytes=10_000, keep=3)
    for step in (9, 11, 12):
        holder.put(snapshot(step))
    assert holder.drop_after(10) == [11, 12]
    assert holder.steps() == [9]
    holder.put(snapshot(11))  # the new attempt's step 11
    assert holder.steps() == [11, 9]
