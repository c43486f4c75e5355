"""A memory snapshot copied while the next step trains (ftjob/memory/snapshot_copy.py): what it
holds is the step it names, bit for bit -- the buffers the next forward pass changes, the
weights and the optimizer state the next optimizer step changes -- the same as a copy taken
on the training thread; the step waits only at ``settle``, before its optimizer's step. The
copy is held back here until the last moment it may run (the training thread enters
``settle``), so a copy that read anything late would hold the next step's values."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ftjob import metrics as M
from ftjob.actors import DirectHandle
from ftjob.config import MemoryConfig
from ftjob.memory import SnapshotHolder
from ftjob.memory.cluster import LocalHolders
from ftjob.memory.node_holders import NodeHolders
from ftjob.memory.tier import MemoryTier
from ftjob.worker.checkpointer import (
    OPTIMIZER_FILE,
    STATE_FILE,
    TrainState,
    load_state,
    snapshot_state,
    snapshot_tensors,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device (the side stream's copy)"
        ),
    ),
]
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),  # keeps no state
}


def model_with_batchnorm(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 4),
    )
    return model.to(device)


def train_step(model: torch.nn.Module, optimizer: Any, seed: int, settle: Any = None) -> None:
    """A step: forward (BatchNorm's statistics change), backward, ``settle``, the optimizer."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(16, 3, 8, 8, generator=generator).to(device)
    labels = torch.randint(0, 4, (16,), generator=generator).to(device)
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()
    if settle is not None:
        settle()
    optimizer.step()


def tier(lines: list[str] | None = None) -> tuple[MemoryTier, SnapshotHolder]:
    holder = SnapshotHolder(cap_bytes=2**26, keep=2)
    log = (lines if lines is not None else []).append
    config = MemoryConfig(enabled=True, max_mb=64.0)
    return MemoryTier(DirectHandle(holder), config, 0, M.MetricSet(), lambda v: v, log), holder


def held_back(memory: MemoryTier) -> threading.Event:
    """The tier's background copy waits until the training thread enters ``settle``: as late
    as it may run. Returns the event that lets it go."""
    go = threading.Event()
    layouts, settle = memory.copier.layouts, memory.copier.settle

    def late(*args: Any) -> Any:  # the first read of the live state on the background thread
        assert go.wait(timeout=60), "the training thread never settled the copy"
        return layouts(*args)

    def settle_then_wait() -> float:
        go.set()
        return settle()

    memory.copier.layouts = late  # type: ignore[method-assign]
    memory.copier.settle = settle_then_wait  # type: ignore[method-assign]
    return go


def restored(holder: SnapshotHolder, step: int, device: str, optimizer_of: Any) -> Any:
    """The held snapshot of ``step`` loaded into a fresh model and optimizer: their states."""
    found = holder.ring.read(step) if holder.ring is not None else holder.get(step)
    assert found is not None and found.verify() is None
    model = model_with_batchnorm(device)
    optimizer = optimizer_of(model.parameters())
    load_state(snapshot_state(found.files, torch.device(device)), model, optimizer)
    return model.state_dict(), optimizer.state_dict()


def assert_same(got: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype
        assert torch.equal(got.cpu(), expected.cpu())
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)
    else:
        assert got == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_a_snapshot_copied_while_the_next_step_trains_holds_its_own_step_bit_for_bit(
    device: str, optimizer_name: str
) -> None:
    optimizer_of = OPTIMIZERS[optimizer_name]
    model = model_with_batchnorm(device)
    optimizer = optimizer_of(model.parameters())
    train_step(model, optimizer, seed=1)  # step 1: the optimizer has its state
    expected = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    beside, beside_holder = tier()
    go = held_back(beside)
    on_thread, on_thread_holder = tier()
    on_thread.overlap_cpu = False  # the copy waited for in take(): the training thread's
    record = TrainState(step=1, position=16, global_batch_size=16).to_json()
    for memory in (on_thread, beside):
        memory.take(1, snapshot_tensors(model, optimizer), lambda: {STATE_FILE: record})
    assert not go.is_set()  # take() returned with the copy not begun

    # Step 2 trains: its forward pass changes BatchNorm's statistics, its optimizer step the
    # weights and the optimizer's state -- after settle, which lets the copy go first.
    train_step(model, optimizer, seed=2, settle=beside.settle)
    assert go.is_set()
    for memory in (beside, on_thread):
        memory.wait()
    assert not torch.equal(model.state_dict()["1.running_mean"], expected[0]["1.running_mean"])
    for holder in (beside_holder, on_thread_holder):
        assert holder.steps() == [1]
        assert_same(restored(holder, 1, device, optimizer_of), expected)
    metrics = beside.metrics
    assert metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOTS) == 1
    assert 0 < metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT)
    assert metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT) < metrics.get(
        M.CHECKPOINT_MEMORY_SNAPSHOT_TIME
    )
    beside.close(timeout=10)
    on_thread.close(timeout=10)


def test_a_step_without_a_snapshot_in_flight_does_not_wait_and_a_skipped_one_is_not_waited_for():
    model = model_with_batchnorm("cpu")
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    memory, holder = tier()
    memory.settle()  # nothing begun: nothing to wait for
    assert memory.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT) == 0
    go = held_back(memory)
    memory.take(1, snapshot_tensors(model, optimizer), lambda: {})
    memory.take(2, snapshot_tensors(model, optimizer), lambda: {})  # step 1's still in flight
    assert memory.skipped == 1
    train_step(model, optimizer, seed=3, settle=memory.settle)
    assert go.is_set()
    memory.wait()
    memory.settle()  # settled once: the next step does not wait again
    assert holder.steps() == [1]
    memory.close(timeout=10)


def test_a_failed_copy_never_leaves_the_step_waiting() -> None:
    model = model_with_batchnorm("cpu")
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    lines: list[str] = []
    memory, holder = tier(lines)

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug in the copy")

    memory.copier.layouts = broken  # type: ignore[method-assign]
    memory.take(1, snapshot_tensors(model, optimizer), lambda: {})
    train_step(model, optimizer, seed=4, settle=memory.settle)  # returns: the copy is dropped
    memory.wait()
    assert holder.steps() == [] and not memory.enabled
    assert any("a snapshot failed (RuntimeError: a bug in the copy)" in line for line in lines)
    memory.close(timeout=10)


def test_optimizer_state_is_read_before_the_step_changes_its_dicts() -> None:
    # The optimizer's state dict shares its per-parameter dicts with the optimizer; a step
    # that replaces an entry (an optimizer that keeps a count as a number) changes them. The
    # snapshot's structure is its own from the moment the copy may no longer read the state.
    model = model_with_batchnorm("cpu")
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    train_step(model, optimizer, seed=5)
    for state in optimizer.state.values():
        state["count"] = 1
    memory, holder = tier()
    held_back(memory)
    memory.take(1, snapshot_tensors(model, optimizer), lambda: {})

    def count_up() -> None:
        memory.settle()
        for state in optimizer.state.values():
            state["count"] += 1

    train_step(model, optimizer, seed=6, settle=count_up)
    memory.wait()
    found = holder.ring.read(1) if holder.ring is not None else holder.get(1)
    assert found is not None
    saved = snapshot_state(found.files, torch.device("cpu"))(OPTIMIZER_FILE)
    assert {state["count"] for state in saved["state"].values()} == {1}
    memory.close(timeout=10)


def test_the_devices_wait_for_the_copy_leaves_the_steps_time_as_the_threads_wait_does() -> None:
    # On a GPU the training stream waits for the copy before the optimizer's kernels, timed on
    # the device and known a few steps later (SnapshotCopy.stalled): it is the snapshot's time,
    # not the step's -- counted in train/step as well, goodput would count it twice.
    memory, _ = tier()
    memory.metrics.add(M.TRAIN_STEP, 1.0)
    stalls = [0.25]
    memory.copier.stalled = lambda: stalls.pop() if stalls else 0.0  # type: ignore[method-assign]
    memory.due(1)  # the device's waits are read as the next snapshot is weighed
    assert memory.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_WAIT) == 0.25
    assert memory.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME) == 0.25
    assert memory.metrics.get(M.TRAIN_STEP) == 0.75
    memory.close(timeout=10)


def two_nodes() -> tuple[MemoryTier, dict[str, SnapshotHolder]]:
    """Rank 0's tier on node0 of two: its own part of each step goes to node1's holder too."""
    held = {node: SnapshotHolder(cap_bytes=2**26, keep=2) for node in ("node0", "node1")}
    directory = LocalHolders({n: DirectHandle(h) for n, h in held.items()})
    config = MemoryConfig(enabled=True, max_mb=64.0)
    place = NodeHolders(directory, "node0", writes=True)
    return MemoryTier(place, config, 0, M.MetricSet(), lambda v: v, print), held


def test_closing_the_tier_waits_for_its_thread_to_end_within_its_bound() -> None:
    """A process that exits while the tier's thread is in torch's work ends it there
    ("terminate called without an active exception"): close() joins the thread -- here busy
    with rank 0's part of a step it skipped, which a slow peer holder takes its time over --
    and never waits past its bound for one stuck in a call that does not return."""
    model = model_with_batchnorm("cpu")
    optimizer = OPTIMIZERS["sgd_momentum"](model.parameters())
    memory, held = two_nodes()
    memory.take(1, snapshot_tensors(model, optimizer), lambda: {})
    memory.wait()
    assert held["node1"].parts  # rank 0's part of step 1 reached its peer: it has one
    release, started = threading.Event(), threading.Event()

    def held_until_released() -> dict[str, Any]:
        assert release.wait(timeout=60)
        return {}

    def slow_part() -> dict[str, Any]:  # as a slow call to a peer's holder would be
        started.set()
        time.sleep(0.3)
        return {}

    memory.take(2, snapshot_tensors(model, optimizer), held_until_released)
    memory.take(3, snapshot_tensors(model, optimizer), slow_part)  # skipped: its part goes
    assert memory.skipped == 1
    release.set()
    assert started.wait(timeout=60)
    thread = memory._thread
    assert thread is not None
    memory.close(timeout=30)
    assert not thread.is_alive()

    # A thread that does not end within the bound is left behind, and close() returns.
    memory, _ = two_nodes()
    release.clear()
    memory.take(1, snapshot_tensors(model, optimizer), held_until_released)  # a call stuck
    thread = memory._thread
    closing = threading.Thread(target=memory.close, args=(0.2,))
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive() and thread is not None and thread.is_alive()
    release.set()  # its call returns: it ends
    thread.join(timeout=30)
    assert not thread.is_alive()
