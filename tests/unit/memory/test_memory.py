"""The memory tier's holder: the newest snapshots within a count and a byte cap, verified by
digest. (Taking and restoring snapshots: tests/unit/worker/test_checkpointer.py; a run restoring
from them: tests/worker/test_worker_local.py and the elastic run, tests/e2e/test_elastic_run.py.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftjob.memory import (
    DIGEST,
    Flat,
    Ring,
    RingRef,
    Snapshot,
    SnapshotHolder,
    digest,
    digest_all,
    machine,
    pack,
    unpack,
)
from ftjob.memory import format as memory_format
from ftjob.memory.holder import PutAnswer

ROOT = Path(__file__).resolve().parents[3]
HERE = machine()


def snapshot(step: int, size: int = 100) -> Snapshot:
    return Snapshot.of(step, {"model.pt": bytes([step % 256]) * size, "state.json": b"{}"})


def test_the_holder_keeps_the_newest_snapshots_within_count_and_cap() -> None:
    holder = SnapshotHolder(cap_bytes=350, keep=3)
    for step in (1, 2, 3):
        assert holder.put(snapshot(step)).kept
    assert holder.steps() == [3, 2, 1]
    assert holder.put(snapshot(4)) == PutAnswer(True, [1])  # the count
    assert holder.put(snapshot(5, size=200)) == PutAnswer(True, [2, 3])  # the cap
    assert holder.steps() == [5, 4] and holder.held_bytes() <= 350
    assert holder.stats()["taken"] == 5 and holder.stats()["dropped"] == 3


def test_a_snapshot_bigger_than_the_cap_is_refused_and_nothing_held_is_dropped() -> None:
    holder = SnapshotHolder(cap_bytes=150, keep=2)
    holder.put(snapshot(1))
    answer = holder.put(snapshot(2, size=1000))
    assert not answer.kept and "does not fit" in answer.reason
    assert holder.steps() == [1]


def test_verification_names_the_file_that_does_not_match() -> None:
    good = snapshot(7)
    assert good.verify() is None
    files = dict(good.files, **{"model.pt": b"x" + good.files["model.pt"][1:]})
    assert Snapshot(7, files, good.digests).verify() == (
        "model.pt does not match its digest (xxh3_128)"
    )
    missing = Snapshot(7, {"state.json": b"{}"}, good.digests).verify()
    assert missing is not None and "do not match" in missing
    holder = SnapshotHolder(cap_bytes=1000, keep=2)
    holder.put(good)
    holder.discard(7)
    assert holder.steps() == [] and holder.get(7) is None


def test_a_digest_names_its_algorithm_and_any_changed_byte_or_other_step_fails_it() -> None:
    array = np.random.default_rng(0).integers(0, 256, 2**20, dtype=np.uint8)
    files = {"model.pt#tensors": array, "state.json": b'{"step": 3}'}
    taken = Snapshot.of(3, files)
    assert all(d.startswith(f"{DIGEST}:") for d in taken.digests.values())
    for index in (0, 2**19 + 7, 2**20 - 1):  # torn: one byte anywhere left from another write
        torn = array.copy()
        torn[index] ^= 0x10
        assert (
            "model.pt#tensors does not match"
            in Snapshot(3, dict(files, **{"model.pt#tensors": torn}), taken.digests).verify()
        )
    stale = Snapshot(3, dict(files, **{"state.json": b'{"step": 2}'}), taken.digests)
    assert "state.json does not match" in stale.verify()
    # The algorithm travels with the digest: SHA-256 ones (named, or bare hex as snapshots were
    # digested before) still verify; an algorithm this version does not know is never trusted.
    named = {n: digest(d, "sha256") for n, d in files.items()}
    bare = {n: hashlib.sha256(memoryview(d)).hexdigest() for n, d in files.items()}
    assert Snapshot(3, files, named).verify() is None and Snapshot(3, files, bare).verify() is None
    unknown = {n: "crc8:00" for n in files}
    assert "does not match its digest (crc8)" in Snapshot(3, files, unknown).verify()


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


def test_a_gpu_states_copy_gathered_in_runs_lands_where_one_copy_a_tensor_puts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state on a GPU is gathered on the device in runs of one dtype and copied to the host a
    run at a time; the path is the device's, the layout logic is tested here on CPU tensors:
    runs broken by size (a tiny stage), by dtype (interleaved), each tensor in its logical
    order whatever its memory format -- the same bytes as a copy per tensor."""
    monkeypatch.setattr(memory_format, "STAGE_BYTES", 40)
    tensors = [
        torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last),
        torch.tensor(3),  # 0-dim, int64, between float32 tensors
        torch.randn(4, 3).t(),  # not contiguous
        torch.randn(5, dtype=torch.bfloat16),
        torch.randn(6),
        torch.tensor([True, False]),
        torch.randn(1),
        torch.randn(30),  # alone bigger than a stage
    ]
    expected = Flat.copy_of({"t": tensors})  # CPU: one copy a tensor, in place
    got = torch.full_like(expected.buffer, 0xAB)
    offsets = [marker[1] for marker in expected.skeleton["t"]]
    memory_format.copy_from_devices(got, offsets, tensors)
    for start, end in expected.regions.values():  # each dtype's run (padding between them)
        assert torch.equal(got[start:end], expected.buffer[start:end])


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
    # Finite values whose sum overflows (float32's, and float16's limit) are still finite.
    assert Flat.copy_of(state(torch.full((4,), 3e38))).all_finite()
    assert Flat.copy_of(state(torch.full((4,), 6e4, dtype=torch.float16))).all_finite()
    for bad in (
        torch.tensor([0.0, float("nan")]),
        torch.tensor([float("-inf")], dtype=torch.bfloat16),
        torch.tensor([1.0, float("inf")], dtype=torch.float64),
    ):
        flat = Flat.copy_of(state(bad))
        assert not flat.all_finite(), bad
        torch.testing.assert_close(flat.views[-1], bad, rtol=0, atol=0, equal_nan=True)


WRITER = """
import json, os, sys
import numpy as np
from ftjob.memory import Ring, digest_all
ring = Ring.attach(json.loads(sys.argv[1]))
slot, payload = ring.claim()
payload[:4] = np.frombuffer(b"abcd", np.uint8)
files = {"model.pt#tensors": payload[:4], "state.json": b"{}"}
payload[64:66] = np.frombuffer(b"{}", np.uint8)
ring.commit(slot, 5, {"model.pt#tensors": (0, 4, True), "state.json": (64, 2, False)},
            digest_all(files))
slot, payload = ring.claim()  # the next one: half written when the process dies
payload[:4] = 7
os.kill(os.getpid(), 9)
"""


def test_a_rank_on_the_holders_machine_writes_into_its_ring_and_a_torn_write_is_never_offered() -> (
    None
):
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    address = holder.channel(4096, HERE)
    assert address is not None and holder.channel(4096, HERE) == address  # one ring
    writer = subprocess.run([sys.executable, "-c", WRITER, json.dumps(address)], cwd=ROOT)
    assert writer.returncode == -9  # killed between its claim and its commit
    assert holder.steps() == [5]  # the committed one; the torn one is not listed
    ref = holder.get(5)
    assert isinstance(ref, RingRef) and ref.step == 5
    snapshot = holder.ring.read(5)
    assert snapshot is not None and snapshot.verify() is None
    assert (
        bytes(snapshot.files["model.pt#tensors"]) == b"abcd"
        and snapshot.files["state.json"] == b"{}"
    )
    copy = holder.copy(5)  # for a reader that cannot map the ring: its own memory
    holder.ring.read(5).files["model.pt#tensors"][0] ^= 1  # a bit flipped in the ring
    assert "model.pt#tensors does not match" in holder.ring.read(5).verify()
    assert copy.verify() is None
    holder.discard(5)
    assert holder.steps() == [] and holder.stats()["taken"] == 1


def test_only_a_process_that_can_map_the_holders_ring_writes_into_it() -> None:
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    address = holder.channel(4096, HERE)
    assert Ring.attach(address) is not None
    assert Ring.attach({**address, "token": "00" * 16}) is None  # another ring behind that path
    assert Ring.attach({**address, "path": "/proc/0/fd/0"}) is None  # another machine's
    assert Ring.attach({**address, "path": "/etc/passwd"}) is None  # never another path
    assert holder.channel(4096, "another machine") is None
    assert holder.channel(8192, HERE) is None  # bigger than its slots: sent instead
    # keep + 1 slots must fit in the cap, beside what was sent
    assert SnapshotHolder(cap_bytes=2**20, keep=2).channel(2**19, HERE) is None
    # A ring made for a writer that then could not map it gives its room back to sent ones.
    unused = SnapshotHolder(cap_bytes=2**20, keep=1)
    assert unused.channel(2**18, HERE) is not None
    assert unused.put(snapshot(1, size=2**19 + 2**18)).kept and unused.ring is None


def test_the_ring_keeps_the_newest_and_drops_the_lost_attempts_later_snapshots() -> None:
    holder = SnapshotHolder(cap_bytes=2**20, keep=2)
    ring = Ring.attach(holder.channel(4096, HERE))
    for step in (1, 2, 3, 4):
        slot, payload = ring.claim()
        payload[:8] = step
        files = {"model.pt#tensors": payload[:8]}
        ring.commit(slot, step, {"model.pt#tensors": (0, 8, True)}, digest_all(files))
        ring.keep_newest(2)
    assert holder.steps() == [4, 3]
    assert holder.stats()["taken"] == 4 and holder.stats()["dropped"] == 2
    assert holder.drop_after(3) == [4] and holder.steps() == [3]
    assert holder.ring.read(3).verify() is None


@pytest.mark.ray
def test_through_ray_a_snapshot_outlives_its_sender_and_a_reader_elsewhere_gets_a_copy() -> None:
    """The holder as a run starts it (a Ray actor on embedded Ray), for ranks that cannot map
    its ring (another machine): snapshots sent through Ray, kept in the holder's object store
    after the sending process is gone; a ring snapshot copied out for such a reader."""
    import ray

    from ftjob import metrics as M
    from ftjob.config import MemoryConfig
    from ftjob.memory import start_holder
    from ftjob.memory.tier import MemoryTier

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        holder = start_holder(64, 2)
        config = MemoryConfig(enabled=True)

        @ray.remote(num_cpus=0, max_calls=1)
        def sender(step: int) -> None:  # a process that sends one snapshot, then ends
            tier = MemoryTier(holder, config, 0, M.MetricSet(), ray.get, print)
            tier.ring = False  # as a rank on another machine
            tier.take(step, state, lambda: {"state.json": {"step": step}})
            tier.close(timeout=30)

        ray.get(sender.remote(7))  # its worker process exits after (max_calls)
        reader = MemoryTier(holder, config, 1, M.MetricSet(), ray.get, print)
        sent = reader.get(7)
        assert sent is not None and sent.verify() is None
        back = unpack(sent.files, "model.pt")
        assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())

        # A ring snapshot (written by a rank on the holder's machine: here, this process)...
        writer = MemoryTier(holder, config, 0, M.MetricSet(), ray.get, print)
        writer.take(8, state, lambda: {"state.json": {"step": 8}})
        writer.close(timeout=30)
        assert isinstance(writer.ring, Ring) and ray.get(holder.steps.remote()) == [8, 7]
        # ...for a reader that cannot map the ring: a copy, through Ray.
        copy = ray.get(ray.get(holder.copy.remote(8)))
        assert copy.verify() is None and copy.digests == writer.get(8).digests
    finally:
        ray.shutdown()


def _states_of_every_shape() -> dict[str, Any]:
    linear = torch.nn.Linear(3, 2)  # a model without buffers
    plain = torch.optim.SGD(linear.parameters(), lr=0.1)  # momentum 0: no state at all
    linear(torch.ones(1, 3)).sum().backward()
    plain.step()
    return {
        "sgd without momentum": plain.state_dict(),
        "empty": {},
        "no buffers": linear.state_dict(),
        "step counters only": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []},
        "bf16 and fp16": {
            "w": torch.randn(3, 4, dtype=torch.bfloat16),
            "h": torch.randn(5, dtype=torch.float16),
            "n": torch.tensor(2),
        },
    }


@pytest.mark.parametrize("kind", sorted(_states_of_every_shape()))
def test_a_state_with_no_tensor_or_few_kinds_of_them_packs_and_comes_back(kind: str) -> None:
    # SGD without momentum keeps no tensor: its copy used to fail every snapshot, and every
    # attempt with it, on a copy of an empty list.
    state = _states_of_every_shape()[kind]
    flat = Flat.copy_of(state)
    assert flat.all_finite()
    files = pack({"optimizer.pt": flat}, {})
    back = unpack(files, "optimizer.pt", torch.device("cpu"))

    def same(a: Any, b: Any) -> bool:
        if isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)
        if isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b)

    assert same(back, state)
    assert Snapshot.of(1, files).verify() is None
