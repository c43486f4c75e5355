"""A worker's side of the memory tier (``checkpoint.memory``, :mod:`ftjob.storage.memory`).

Taking: every ``every_n_steps`` steps rank 0 copies the model's and optimizer's tensors (the
only part on the training thread: a memory copy, so the next step can change the weights)
and hands the copy to a background thread, which serialises it as a durable checkpoint's files
and gives it to the run's holder. One snapshot is in flight at a time; a due snapshot while
one is still being sent is skipped (training never waits for the tier). The state is the same
on every rank (DDP), so rank 0's copy serves all of them.

Restoring: rank 0 offers the newest held snapshot that is newer than every committed durable
checkpoint and verifies; every rank loads it. A snapshot that fails verification is dropped
from the holder with a line, never loaded.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ftjob import metrics as M
from ftjob.config import MemoryConfig
from ftjob.storage.memory import Snapshot

MEMORY_PREFIX = "memory:"


def holder_errors() -> tuple[type[BaseException], ...]:
    """What a call to a holder that is gone raises: Ray's errors (a dead actor, a lost
    object), or a connection's (the local harness's manager)."""
    import ray.exceptions

    return (ray.exceptions.RayError, ConnectionError, EOFError)


def copy_tensors(state: Any) -> Any:
    """A copy of a state dict (nested dicts and lists) whose tensors are detached CPU copies."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: copy_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copy_tensors(v) for v in state)
    return state


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a state dict."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def all_finite(state: Any) -> bool:
    """No NaN or inf in the floating-point tensors of a state dict."""
    import torch

    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(all_finite(v) for v in state)
    return True


def serialise(tensors: dict[str, Any], records: dict[str, Any]) -> dict[str, bytes]:
    """A checkpoint's files in memory: ``tensors`` as torch.save writes them, ``records`` as
    JSON -- byte for byte what a durable checkpoint holds."""
    import torch

    files = {}
    for name, state in tensors.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        files[name] = buffer.getvalue()
    for name, record in records.items():
        files[name] = json.dumps(record).encode()
    return files


class MemoryTier:
    """Rank 0 takes snapshots; every rank restores from one. ``holder``: the run's
    :class:`~ftjob.storage.memory.SnapshotHolder` handle; ``fetch`` resolves its answers."""

    def __init__(
        self,
        holder: Any,
        config: MemoryConfig,
        rank: int,
        metrics: M.MetricSet,
        fetch: Callable[[Any], Any],
        log: Callable[[str], None],
    ) -> None:
        self.holder, self.every, self.cap_mb = holder, config.every_n_steps, config.max_mb
        self.rank, self.metrics, self.fetch, self.log = rank, metrics, fetch, log
        self.enabled = holder is not None
        self._sending: threading.Thread | None = None
        self._offered: Snapshot | None = None  # rank 0: the snapshot a restore chose
        self.skipped = 0

    # -- taking ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.enabled and self.rank == 0 and step % self.every == 0

    def take(
        self, step: int, tensors: dict[str, Any], records: Callable[[], dict[str, Any]]
    ) -> None:
        """Rank 0, after ``step``: copy the state (the stall) and send it in the background.
        ``tensors``: file name -> state dict (model, optimizer); ``records``: the JSON files
        of the snapshot (state.json, config.json), built now."""
        if self._sending is not None and self._sending.is_alive():
            self.skipped += 1  # the previous one is still being sent: training goes on
            return
        start = time.perf_counter()
        size = state_bytes(tensors) / 2**20
        if size > self.cap_mb:
            self._turn_off(
                f"the training state ({size:.0f} MB) does not fit in "
                f"checkpoint.memory.max_mb={self.cap_mb:g}"
            )
            return
        copied = {name: copy_tensors(state) for name, state in tensors.items()}
        files_records = records()
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOT_TIME, time.perf_counter() - start)
        self._sending = threading.Thread(
            target=self._send,
            args=(step, copied, files_records),
            name="ftjob-snapshot",
            daemon=True,
        )
        self._sending.start()

    def _send(self, step: int, tensors: dict[str, Any], records: dict[str, Any]) -> None:
        if not all_finite(tensors):  # diverged weights are never held (nor restored)
            return
        snapshot = Snapshot.of(step, serialise(tensors, records))
        del tensors  # the copy, serialised: only the bytes stay until the holder has them
        try:
            answer = self.fetch(self.holder.put.remote(snapshot))
        except holder_errors() as exc:  # the holder is gone (the run is ending): storage remains
            self._turn_off(f"the snapshot holder did not answer ({type(exc).__name__}: {exc})")
            return
        if not answer["kept"]:
            self._turn_off(answer["reason"])
            return
        self.metrics.add(M.CHECKPOINT_MEMORY_SNAPSHOTS, 1)

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            self.log(f"memory tier off for this run: {why}; restores read storage")

    def wait(self, timeout: float | None = None) -> None:
        """Until the snapshot in flight, if any, is held (or ``timeout`` seconds): an attempt
        that ends (an error, a notice) first lets its newest snapshot reach the holder."""
        if self._sending is not None:
            self._sending.join(timeout)

    def restored(self, step: int) -> None:
        """After every restore (of either tier, or of nothing: step 0), rank 0 drops the
        snapshots past ``step``: they belong to the attempt that was lost."""
        if self.holder is not None and self.rank == 0:
            try:
                self.fetch(self.holder.drop_after.remote(step))
            except holder_errors() as exc:
                self._turn_off(f"the snapshot holder did not answer ({type(exc).__name__}: {exc})")

    # -- restoring ------------------------------------------------------------------------

    def newest(self, committed: Callable[[], list[int]]) -> Snapshot | None:
        """Rank 0: the newest held snapshot newer than every committed durable checkpoint
        (``committed()``: their steps, newest first) that verifies; one that does not is
        dropped from the holder, with a line."""
        if self.holder is None:
            return None
        try:
            steps = self.fetch(self.holder.steps.remote())
        except holder_errors() as exc:
            self.log(f"memory tier: the snapshot holder did not answer ({exc}); reading storage")
            return None
        durable = committed() if steps else []
        after_step = durable[0] if durable else -1
        for step in steps:
            if step <= after_step:
                return None
            snapshot = self.get(step)
            if snapshot is not None:
                return snapshot
        return None

    def offer(self, committed: Callable[[], list[int]]) -> tuple[Any, ...] | None:
        """Rank 0: the restore choice for the newest verified snapshot newer than storage
        (:meth:`newest`) -- (step, path, None, its digests) -- or None."""
        self._offered = self.newest(committed)
        if self._offered is None:
            return None
        step = self._offered.step
        return step, f"{MEMORY_PREFIX}step_{step:09d}", None, self._offered.digests

    def files(self, step: int, digests: dict[str, str]) -> dict[str, bytes]:
        """Every rank: the files of the snapshot rank 0 chose (rank 0 verified its own
        copy; the others verify theirs and that it is the same one)."""
        if self.rank == 0 and self._offered is not None and self._offered.step == step:
            return self._offered.files
        return self.chosen(step, digests).files

    def chosen(self, step: int, digests: dict[str, str]) -> Snapshot:
        """Ranks > 0: their copy of the snapshot rank 0 chose (``digests``: rank 0's), verified
        and the same one (else raises: the attempt fails, and the next one reads storage) --
        every rank loads the same state."""
        snapshot = self.get(step)
        if snapshot is None or snapshot.digests != digests:
            raise RuntimeError(
                f"rank {self.rank}: the memory snapshot of step {step} rank 0 chose does not "
                "verify here, or is another one"
            )
        return snapshot

    def get(self, step: int) -> Snapshot | None:
        """The snapshot of ``step`` if it verifies (else dropped from the holder, said)."""
        snapshot = self.fetch(self.holder.get.remote(step))
        why = "it is no longer held" if snapshot is None else snapshot.verify()
        if why is None:
            return snapshot
        self.fetch(self.holder.discard.remote(step))
        self.log(f"memory snapshot of step {step} is not usable ({why}): skipped")
        return None


__all__ = ["MEMORY_PREFIX", "MemoryTier", "all_finite", "copy_tensors", "serialise", "state_bytes"]
