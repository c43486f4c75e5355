"""The memory tier's holder: the newest snapshots within a count and a byte cap, verified by
digest. (Taking and restoring snapshots: test_checkpointer.py; a run restoring from them:
test_worker_local.py and the elastic run, test_chaos_e2e.py.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ftjob.storage.memory import Snapshot, SnapshotHolder
from ftjob.worker.snapshots import Flat, pack, unpack


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


def test_a_packed_state_comes_back_exactly_and_travels_as_arrays() -> None:
    state = {
        "weight": torch.randn(3, 4).t(),  # not contiguous
        "half": torch.randn(5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(7),  # 0-dim
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "state": {0: {"momentum_buffer": torch.randn(2, 2)}},
    }
    momentum = state["state"][0]["momentum_buffer"].clone()
    flat = Flat.copy_of(state)
    state["state"][0]["momentum_buffer"].add_(1.0)  # the next step: the copy keeps its values
    assert not torch.equal(flat.views[-1], state["state"][0]["momentum_buffer"])
    state["state"][0]["momentum_buffer"].sub_(1.0)
    files = pack({"optimizer.pt": flat}, {"state.json": {"step": 7}})
    [array] = [data for data in files.values() if isinstance(data, np.ndarray)]
    assert array.dtype == np.uint8 and array.ndim == 1  # one buffer a file: one digest, no pickling
    assert files["state.json"] == b'{"step": 7}'

    # As they come out of Ray's object store: read-only. With a device the tensors are the
    # state's own (an optimizer keeps and updates them); without, views (a module copies).
    array.flags.writeable = False
    back = unpack(files, "optimizer.pt", torch.device("cpu"))
    assert back["groups"] == state["groups"] and back["state"][0].keys() == {"momentum_buffer"}
    for key in ("weight", "half", "mask", "step"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert torch.equal(back["state"][0]["momentum_buffer"], momentum)
    back["state"][0]["momentum_buffer"].add_(1.0)  # writable: its own memory
    view = unpack(files, "optimizer.pt")["weight"]
    assert torch.equal(view, state["weight"])


def test_the_holder_keeps_its_own_copy_of_a_snapshots_arrays() -> None:
    sent = np.arange(16, dtype=np.uint8)
    holder = SnapshotHolder(cap_bytes=1000, keep=1)
    holder.put(Snapshot.of(3, {"model.pt#0": sent, "model.pt": b"skeleton"}))
    sent[:] = 0  # the sender's buffer goes (a worker that dies, its object store copy)
    held = holder.get(3)
    assert held is not None and held.verify() is None and held.nbytes == 16 + 8


def test_a_nan_or_inf_in_any_floating_tensor_is_found_and_integers_are_not_checked() -> None:
    def state(bad: Any) -> dict[str, Any]:
        return {
            "a": torch.ones(3),
            "count": torch.tensor(-1),  # an int64 whose bytes read as a float are a NaN
            "half": torch.ones(5, dtype=torch.bfloat16),
            "b": torch.ones(2, 2),
            "bad": bad,
        }

    assert Flat.copy_of(state(torch.zeros(1))).all_finite()
    for bad in (
        torch.tensor([0.0, float("nan")]),
        torch.tensor([float("-inf")], dtype=torch.bfloat16),
        torch.tensor([1.0, float("inf")], dtype=torch.float64),
    ):
        flat = Flat.copy_of(state(bad))
        assert not flat.all_finite(), bad
        torch.testing.assert_close(flat.views[-1], bad, rtol=0, atol=0, equal_nan=True)
