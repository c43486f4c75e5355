"""A worker's checkpoint protocol without Ray (rank 0 of a world of 1): real model and
optimizer saved and restored, what happens to checkpoints that do not verify, and why a run
never ends without its final checkpoint."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from ftjob import metrics as M
from ftjob.actors import DirectHandle
from ftjob.config import CheckpointConfig, MemoryConfig
from ftjob.memory import Ring, Snapshot, SnapshotHolder
from ftjob.memory.node_holders import bind_holders
from ftjob.memory.tier import MemoryTier
from ftjob.storage.fs import RetryingFileSystem
from ftjob.storage.retry import RetryPolicy
from ftjob.worker.checkpointer import Checkpointer, NoUsableCheckpoint, TrainState
from ftjob.worker.recorder import JobStopped, RunRecorder
from tests.support.checkpoints import flip_bytes, manifest_in, remote
from tests.support.storage import RecordingFileSystem, no_sleep_policy


class Call:
    def __init__(self, log: list[tuple[str, Any]], name: str) -> None:
        self.log, self.name = log, name

    def remote(self, *args: Any) -> None:
        self.log.append((self.name, args))


class FakeLedger:
    """Records what the checkpointer tells the run ledger."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Call:
        return Call(self.calls, name)

    def fatal(self) -> str | None:
        return next((args[0] for name, args in self.calls if name == "set_fatal"), None)


class Fence:
    """A run lease's fence for a driver of lease ``generation`` that lets every write through
    (whether it should is the lease's test): what a checkpoint's objects and a snapshot's
    writes are stamped with."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def __call__(self) -> None:
        return None


def make(
    tmp_path: Path,
    fs: Any = None,
    global_batch: int = 32,
    holder: Any = None,
    fence: Fence | None = None,
    **config: Any,
) -> tuple[Checkpointer, FakeLedger]:
    ledger = FakeLedger()
    policy: RetryPolicy = no_sleep_policy()
    metrics = M.MetricSet()
    recorder = RunRecorder(ledger, 0, lambda value, timeout=None: value, attempt=0)
    answer = lambda value: value  # noqa: E731 -- a DirectHandle answers at once
    tier = MemoryConfig(enabled=True, max_mb=64.0)
    generation = fence.generation if fence is not None else None
    place = bind_holders(holder, 0, generation=generation)
    memory = MemoryTier(place, tier, 0, metrics, answer, recorder.log) if holder else None
    checkpointer = Checkpointer(
        fs=fs or RetryingFileSystem(LocalFileSystem(), policy),
        run_path=str(tmp_path / "storage" / "run"),
        config=CheckpointConfig(**config),
        job_config={"job": "config"},
        recorder=recorder,
        world=1,
        broadcast=lambda obj: obj,
        report=lambda metrics: None,  # Ray Train's barrier
        metrics=metrics,
        local_root=str(tmp_path / "scratch"),
        global_batch=global_batch,
        memory=memory,
        fence=fence,
    )
    return checkpointer, ledger


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_saved_step_restores_model_optimizer_and_position(tmp_path: Path) -> None:
    checkpointer, ledger = make(tmp_path)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=7, epoch=1, position=64), model, optimizer)
    fresh, fresh_optimizer = model_and_optimizer(1)
    assert not torch.equal(fresh.weight, model.weight)
    restored = checkpointer.restore(fresh, fresh_optimizer, "cpu")
    assert restored is not None
    s = restored.state
    assert (s.step, s.epoch, s.position, s.global_batch_size) == (7, 1, 64, 32)
    assert torch.equal(fresh.weight, model.weight)
    assert os.listdir(tmp_path / "scratch") == []  # the local copy is gone once loaded
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert [name for name, _ in ledger.calls if name == "checkpoint"] == ["checkpoint"]
    other, _ = make(tmp_path, global_batch=64)
    with pytest.raises(RuntimeError, match="global batch 32, this run uses 64"):
        other.restore(fresh, fresh_optimizer, "cpu")


def test_no_verifying_checkpoint_stops_the_job_and_deletes_nothing(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=5), model, optimizer)
    flip_bytes(checkpointer.store, 5)
    with pytest.raises(NoUsableCheckpoint, match="restart_if_unrecoverable=true") as err:
        checkpointer.restore(model, optimizer, "cpu")
    assert "step 5: model.pt does not match its checksum" in str(err.value)
    assert checkpointer.store.steps() == []
    [moved] = checkpointer.store.fs.ls(checkpointer.store.quarantine_root, detail=False)
    manifest = manifest_in(checkpointer.store.fs, moved)
    assert checkpointer.store.fs.exists(f"{moved}/{manifest['files']['model.pt']['object']}")
    assert str(checkpointer.store.quarantine_root) in str(err.value)  # said where they are


def test_starting_over_is_allowed_only_when_asked(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path, restart_if_unrecoverable=True)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=5), model, optimizer)
    flip_bytes(checkpointer.store, 5)
    assert checkpointer.restore(model, optimizer, "cpu") is None


def test_an_upload_that_never_completed_is_set_aside_and_training_starts_over(
    tmp_path: Path,
) -> None:
    checkpointer, _ = make(tmp_path)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=5), model, optimizer)
    checkpointer.store.fs.rm_file(checkpointer.store.manifest_path(5))  # killed mid-upload
    # Written just now: an upload may still be in flight (another attempt's rank 0, a deposed
    # driver), so it is left where it is.
    assert checkpointer.restore(model, optimizer, "cpu") is None
    assert checkpointer.store.steps() == [5]
    directory = checkpointer.store.path_for(5)
    for name in os.listdir(directory):  # silent for longer than checkpoint.lease_timeout
        stamp = time.time() - checkpointer.config.lease_timeout - 1
        os.utime(os.path.join(directory, name), (stamp, stamp))
    assert checkpointer.restore(model, optimizer, "cpu") is None
    assert checkpointer.store.steps() == []
    [moved] = checkpointer.store.fs.ls(checkpointer.store.quarantine_root, detail=False)
    assert sorted(n.split(".")[0] for n in os.listdir(moved)) == [
        "QUARANTINED",
        "config",
        "model",
        "optimizer",
        "state",
    ]


def test_retention_keeps_the_newest_committed_checkpoints(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path, num_to_keep=2)
    model, optimizer = model_and_optimizer(0)
    for step in (10, 20, 30):
        checkpointer.save(TrainState(step=step), model, optimizer)
    assert checkpointer.store.steps() == [30, 20]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_never_ends_without_its_final_checkpoint(tmp_path: Path, mode: str) -> None:
    def deny_step_20(op: str, path: str) -> BaseException | None:
        return PermissionError("AccessDenied") if "step_000000020" in path else None

    fs = RetryingFileSystem(RecordingFileSystem(LocalFileSystem(), deny_step_20), no_sleep_policy())
    # One failed upload in a row is tolerated mid-run...
    checkpointer, ledger = make(tmp_path, fs, upload_mode=mode, max_consecutive_upload_failures=1)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10), model, optimizer)
    checkpointer.save(TrainState(step=20), model, optimizer)
    # ...but not as the last one: the run ends failed, naming the step and what survives.
    with pytest.raises(JobStopped):
        checkpointer.finish(TrainState(step=20))
    fatal = ledger.fatal()
    assert fatal is not None and fatal.startswith(
        "the final checkpoint (step 20) was not committed"
    )
    assert "AccessDenied" in fatal and checkpointer.store.path_for(10) in fatal


def test_a_bug_in_checkpoint_code_is_not_a_tolerated_upload_failure(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path, max_consecutive_upload_failures=5)
    store = checkpointer.store

    def broken_commit(local_dir: str, step: int) -> str:
        raise AttributeError("'NoneType' object has no attribute 'put_file'")

    store.commit = broken_commit  # type: ignore[method-assign]
    model, optimizer = model_and_optimizer(0)
    with pytest.raises(AttributeError):
        checkpointer.save(TrainState(step=10), model, optimizer)
    assert checkpointer.failed_uploads == 0  # not counted against the upload budget


def test_a_just_in_time_checkpoint_commits_this_step_before_it_returns(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path, upload_mode="async")
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10), model, optimizer)  # in flight
    record = checkpointer.save_now(TrainState(step=13), model, optimizer)
    assert record.step == 13 and record.path == checkpointer.store.path_for(13)
    assert checkpointer.store.steps() == [13, 10]  # the one in flight finished first


def test_a_periodic_checkpoint_of_the_same_step_is_the_just_in_time_one(tmp_path: Path) -> None:
    checkpointer, ledger = make(tmp_path, upload_mode="async")
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=20), model, optimizer)  # notice came during it
    record = checkpointer.save_now(TrainState(step=20), model, optimizer)
    assert record.reused and record.path == checkpointer.store.path_for(20)
    assert [name for name, _ in ledger.calls].count("checkpoint") == 1  # uploaded once


def test_no_just_in_time_checkpoint_when_the_deadline_is_too_close(tmp_path: Path) -> None:
    checkpointer, _ = make(tmp_path)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10), model, optimizer)
    record = checkpointer.save_now(TrainState(step=12), model, optimizer, time.time() + 0.2)
    assert record.path is None and "falling back to the last committed one" in (record.reason or "")
    assert checkpointer.store.steps() == [10]


def test_a_full_scratch_disk_is_a_failed_checkpoint_with_its_cause_not_a_crash(
    tmp_path: Path,
) -> None:
    checkpointer, ledger = make(tmp_path, max_consecutive_upload_failures=1)
    model, optimizer = model_and_optimizer(0)
    for step in (10, 20):  # the next writes of model.pt land on a full device
        out = tmp_path / "scratch" / f"out_{step:09d}"
        out.mkdir(parents=True)
        (out / "model.pt").symlink_to("/dev/full")
    checkpointer.save(TrainState(step=10), model, optimizer)  # within the budget
    [(_, (_, record))] = [c for c in ledger.calls if c[0] == "checkpoint"]
    assert record.path is None and "No space left on device" in (record.error or "")
    assert "scratch" in (record.error or "") and "MB free there" in (record.error or "")
    assert "\n" not in (record.error or "")
    with pytest.raises(JobStopped):
        checkpointer.save(TrainState(step=20), model, optimizer)  # over it
    assert "2 checkpoint upload(s) in a row failed" in (ledger.fatal() or "")


class PlantedCode:
    """What a file planted in shared storage could carry: code that runs when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_checkpoint_file_planted_in_storage_cannot_run_code_at_restore(tmp_path: Path) -> None:
    import pickle

    checkpointer, _ = make(tmp_path)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=5, global_batch_size=32), model, optimizer)
    # Someone with write access to the storage plants a model.pt, with a manifest to match.
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "code-ran"
    with open(planted / "model.pt", "wb") as f:
        torch.save({"weight": PlantedCode(str(marker))}, f, pickle_module=pickle)
    for name in ("optimizer.pt", "state.json"):
        (planted / name).write_bytes(checkpointer.store.read_file(5, name))
    checkpointer.store.commit(str(planted), 5)
    with pytest.raises(pickle.UnpicklingError):
        checkpointer.restore(model, optimizer, torch.device("cpu"))
    assert not marker.exists()


def test_the_checkpoint_section_is_entered_only_when_a_checkpoint_is_written(tmp_path: Path):
    # The heartbeat learns the section's timeout from its durations: steps without a
    # checkpoint must not teach it that checkpoints take no time.
    from contextlib import contextmanager

    from ftjob.policy.cadence import CheckpointSchedule

    checkpointer, _ = make(tmp_path)
    checkpointer.schedule = CheckpointSchedule(10, None)
    model, optimizer = model_and_optimizer(0)
    entered: list[tuple[str, int]] = []

    @contextmanager
    def section(name: str):
        entered.append((name, state.step))
        yield

    for step in range(1, 23):
        state = TrainState(step=step, position=step * 32)
        checkpointer.maybe_save(state, model, optimizer, epoch_end=step == 22, section=section)
    assert entered == [("checkpoint", 10), ("checkpoint", 20), ("checkpoint", 22)]
    assert checkpointer.store.steps() == [22, 20]


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(params=["ring", "sent"])
def channel(request: pytest.FixtureRequest) -> str:
    """How snapshots reach the holder: written into its shared-memory ring (a rank on its
    machine), or sent to it (any other; here: a cap with no room for a ring)."""
    return request.param


def tiered(tmp_path: Path, channel: str) -> tuple[SnapshotHolder, Checkpointer, FakeLedger]:
    """A checkpointer with the memory tier on, its holder called directly."""
    holder = SnapshotHolder(cap_bytes=2**20 if channel == "sent" else 2**24, keep=2)
    checkpointer, ledger = make(tmp_path, holder=DirectHandle(holder))
    return holder, checkpointer, ledger


def held(holder: SnapshotHolder, step: int) -> Snapshot:
    """The snapshot of ``step`` as the holder holds it (in the ring: its memory, not a copy)."""
    found = holder.ring.read(step) if holder.ring is not None else holder.get(step)
    assert found is not None
    return found


def step_done(checkpointer: Checkpointer, state: TrainState, model: Any, optimizer: Any) -> None:
    """After a step that is no durable checkpoint's: its snapshot, held once this returns."""
    checkpointer.maybe_save(state, model, optimizer, False)
    checkpointer.memory.wait()


def test_a_memory_snapshot_newer_than_storage_is_restored_from_memory(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, _ = tiered(tmp_path, channel)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10, epoch=0, position=320), model, optimizer)
    for step in (11, 12, 13):  # each a step on: the newest two are held
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        step_done(checkpointer, TrainState(step=step, position=32 * step), model, optimizer)
    assert holder.steps() == [13, 12]
    assert isinstance(checkpointer.memory.ring, Ring) == (channel == "ring")  # written there
    assert checkpointer.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOTS) == 3
    assert checkpointer.metrics.get(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME) > 0
    expected = weights(model)

    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = checkpointer.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.tier == "memory"
    assert (restored.state.step, restored.state.position) == (13, 13 * 32)
    assert restored.path == "memory:step_000000013" and restored.record(0.0).tier == "memory"
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), expected, strict=True))
    assert (
        fresh_optimizer.state_dict()["state"][0]["step"]
        == optimizer.state_dict()["state"][0]["step"]
    )


def test_a_damaged_newer_durable_checkpoint_does_not_pass_over_a_good_snapshot(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, _ = tiered(tmp_path, channel)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10, epoch=0, position=320), model, optimizer)
    for step in (11, 12, 13):
        step_done(checkpointer, TrainState(step=step, position=32 * step), model, optimizer)
    checkpointer.save(TrainState(step=14, epoch=0, position=448), model, optimizer)
    store = checkpointer.store
    model_file = remote(store, 14, "model.pt")
    store.fs.pipe_file(model_file, store.fs.cat_file(model_file)[:64])  # truncated
    next_attempt, _ = make(tmp_path, holder=DirectHandle(holder))
    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = next_attempt.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.tier == "memory" and restored.state.step == 13


def test_a_deposed_drivers_later_durable_step_never_hides_the_live_runs_newer_snapshot(
    tmp_path: Path, channel: str
) -> None:
    """Storage ranks a deposed driver's late commit below every checkpoint of the generation
    that took over, whatever its step: so does a restore that weighs a snapshot against it.
    Right after a takeover, before the live driver commits anything, a step the deposed one
    committed past its fence (30) must not pass for newer than the live run's snapshot (25)."""
    holder = SnapshotHolder(cap_bytes=2**20 if channel == "sent" else 2**24, keep=2)
    deposed, _ = make(tmp_path, fence=Fence(1))
    model, optimizer = model_and_optimizer(0)
    deposed.save(TrainState(step=20, epoch=0, position=640), model, optimizer)
    assert holder.fence(2) is None  # the next driver took the run, before its workers start
    live, _ = make(tmp_path, holder=DirectHandle(holder), fence=Fence(2))
    ours, its_optimizer = model_and_optimizer(2)  # what the live run trained since step 20
    step_done(live, TrainState(step=25, position=800), ours, its_optimizer)
    deposed.save(TrainState(step=30, epoch=0, position=960), model, optimizer)  # past its fence
    assert live.store.newest_verified() == [(1, 30)]  # storage's newest: no commit of gen 2 yet

    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = live.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.tier == "memory" and restored.state.step == 25
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(ours), strict=True))
    # Once the live run has committed a step of its own, that checkpoint ranks above both.
    live.save(TrainState(step=26, epoch=0, position=832), ours, its_optimizer)
    again = live.restore(*model_and_optimizer(1), torch.device("cpu"))
    assert again is not None and again.tier == "storage" and again.state.step == 26


def test_a_snapshot_that_fails_verification_is_skipped_for_the_durable_checkpoint(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, ledger = tiered(tmp_path, channel)
    model, optimizer = model_and_optimizer(0)
    checkpointer.save(TrainState(step=10, epoch=0, position=320), model, optimizer)
    saved = weights(model)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    step_done(checkpointer, TrainState(step=11, position=352), model, optimizer)
    held(holder, 11).files["model.pt#tensors"][0] ^= 0x01  # a bit flipped in memory

    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = checkpointer.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.tier == "storage" and restored.state.step == 10
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), saved, strict=True))
    assert holder.steps() == []  # dropped: never offered again
    said = [args[0] for name, args in ledger.calls if name == "log"]
    assert any(
        "memory snapshot of step 11 is not usable (model.pt#tensors" in line for line in said
    )


def test_a_durable_checkpoint_as_new_as_the_snapshot_wins_and_no_snapshot_is_taken_with_it(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, _ = tiered(tmp_path, channel)
    model, optimizer = model_and_optimizer(0)
    step_done(checkpointer, TrainState(step=4, position=128), model, optimizer)
    checkpointer.maybe_save(TrainState(step=5, epoch=1), model, optimizer, True)  # epoch end
    assert holder.steps() == [4]  # the durable checkpoint of step 5 needs no snapshot
    fresh, fresh_optimizer = model_and_optimizer(1)
    restored = checkpointer.restore(fresh, fresh_optimizer, torch.device("cpu"))
    assert restored is not None and restored.tier == "storage" and restored.state.step == 5


def test_a_state_bigger_than_the_cap_turns_the_tier_off_with_one_line(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, ledger = tiered(tmp_path, channel)
    checkpointer.memory.writer.cap_mb = 1e-4  # 100 bytes: the Linear(4, 3) and AdamW's exceed it
    model, optimizer = model_and_optimizer(0)
    for step in (1, 2):
        step_done(checkpointer, TrainState(step=step), model, optimizer)
    assert holder.steps() == [] and not checkpointer.memory.enabled
    said = [args[0] for name, args in ledger.calls if name == "log"]
    assert len([line for line in said if line.startswith("memory tier off")]) == 1
    assert "checkpoint.memory.max_mb" in said[0]


def test_diverged_weights_are_never_held_and_ranks_refuse_another_snapshot(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, _ = tiered(tmp_path, channel)
    model, optimizer = model_and_optimizer(0)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    step_done(checkpointer, TrainState(step=3), model, optimizer)
    assert holder.steps() == []  # a NaN never reaches the holder
    with torch.no_grad():
        model.weight[0, 0] = 0.0
    step_done(checkpointer, TrainState(step=4), model, optimizer)
    digests = held(holder, 4).digests
    assert checkpointer.memory.chosen(4, digests) is not None
    with pytest.raises(RuntimeError, match="does not verify here, or is another one"):
        checkpointer.memory.chosen(4, {**digests, "model.pt": "0" * 64})


def test_a_snapshot_that_fails_turns_the_tier_off_with_a_line_and_nothing_waits_on_it(
    tmp_path: Path, channel: str
) -> None:
    holder, checkpointer, ledger = tiered(tmp_path, channel)
    tier = checkpointer.memory
    model, optimizer = model_and_optimizer(0)
    state = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}
    tier.take(1, state, lambda: {"state.json": {"step": object()}})  # cannot be written as JSON
    tier.wait(timeout=30)
    assert not tier.enabled and not tier.due(2) and holder.steps() == []
    said = [args[0] for name, args in ledger.calls if name == "log"]
    assert any("memory tier off for this run: a snapshot failed (TypeError" in s for s in said)
    sender = tier._thread
    assert sender is not None and sender.is_alive()  # it lived through the failure
    tier.close(timeout=30)
    sender.join(timeout=10)
    assert not sender.is_alive()  # and ends with the attempt


def test_a_state_that_outgrows_the_ring_is_sent_with_a_line(tmp_path: Path) -> None:
    holder, checkpointer, ledger = tiered(tmp_path, "ring")
    tier = checkpointer.memory
    model, optimizer = model_and_optimizer(0)
    tier.take(1, {"model.pt": model.state_dict()}, lambda: {})
    tier.wait(timeout=30)
    assert isinstance(tier.ring, Ring) and holder.steps() == [1]
    grown = {"model.pt": {**model.state_dict(), "extra": torch.zeros(2**19)}}  # 2 MB more
    tier.take(2, grown, lambda: {})
    tier.wait(timeout=30)
    assert tier.ring is False and holder.steps() == [2, 1]  # 2: sent; 1: still in the ring
    assert tier.get(2) is not None and tier.get(1) is not None
    said = [args[0] for name, args in ledger.calls if name == "log"]
    assert (
        said.count("memory tier: the state outgrew the holder's shared memory; sent through Ray")
        == 1
    )


def test_an_optimizer_that_keeps_no_state_is_snapshotted_and_restored(
    tmp_path: Path, channel: str
) -> None:
    # SGD without momentum (torch's default) keeps no tensor: each snapshot used to fail, and
    # the attempt with it.
    holder, checkpointer, ledger = tiered(tmp_path, channel)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        checkpointer.memory.settle()
        optimizer.step()
        step_done(checkpointer, TrainState(step=step, position=32 * step), model, optimizer)
    assert holder.steps() == [2, 1] and checkpointer.memory.enabled
    fresh = torch.nn.Linear(4, 3)
    restored = checkpointer.restore(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), torch.device("cpu")
    )
    assert restored is not None and restored.tier == "memory" and restored.state.step == 2
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh), weights(model), strict=True))
    assert not [args for name, args in ledger.calls if name == "log" and "off" in args[0]]
