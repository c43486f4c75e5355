"""A memory-tier snapshot's copy of the training state, made while the next step trains.

The snapshot of step N holds the weights, the optimizer state and the module's buffers as step
N left them. The weights and the optimizer state change only in ``optimizer.step()``; the
buffers (BatchNorm's running statistics) change in the next step's forward pass. So the
training thread takes only the buffers' values (:meth:`SnapshotCopy.begin`: small, gathered on
their own device, a run a dtype), and the tier's background thread lays the state out and
copies the rest (:meth:`SnapshotCopy.copy`) while the next step's forward and backward passes
run; that step calls :meth:`SnapshotCopy.settle` before its ``optimizer.step()``, which returns
once the copy can no longer see what the optimizer changes.

On a GPU the copy is queued on a side stream that starts where the training stream stood at
``begin`` (an event): each run of a dtype gathered on the device and copied into the ring,
page-locked, without a wait per copy (the pattern of torch's asynchronous checkpoint staging
and DLRover's flash checkpoint). ``settle`` makes the training stream wait for the copy's
event: the training thread itself waits only until the copy is queued, and the device waits
only where the copy has not ended when the optimizer's kernels are due -- measured on the
device (timing events, :meth:`SnapshotCopy.stalled`). On the CPU the background thread copies
the same way, its memory copy running beside the step's forward and backward passes;
``settle`` waits for it to end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ftjob.memory.format import Flat, Layout
from ftjob.memory.node_holders import BUFFERS_SUFFIX, split_buffers


@dataclass(frozen=True)
class Staged:
    """What :meth:`SnapshotCopy.begin` took on the training thread: the snapshot's state files
    in order (``order``), those the background thread copies from the live state (``live``:
    the weights, the optimizer's state), the buffers' layouts and their values as taken
    (``held``), the GPU the state lies on (None: the CPU) and where the training stream stood
    (``start``, a CUDA event)."""

    order: list[str]
    live: dict[str, Any]
    held: dict[str, tuple[Layout, list[tuple[int, Any]]]]
    device: Any = None
    start: Any = None


class SnapshotCopy:
    """One writer's copies, one at a time: :meth:`begin` on the training thread, :meth:`copy`
    (or :meth:`held_copy`) on the background thread, :meth:`settle` on the training thread
    before the optimizer's step."""

    def __init__(self) -> None:
        self._copied = threading.Event()  # the live state is no longer read
        self._copied.set()
        self._pending = False  # a copy began that no settle has waited for yet
        self._device: Any = None
        self._done: Any = None  # the side stream's event after the last copy (a GPU's)
        self._stream: Any = None
        self._stalls: list[tuple[Any, Any]] = []  # timing events around the stream's waits

    def begin(self, tensors: dict[str, Any], part: bool = False) -> Staged:
        """The training thread: the snapshot of ``tensors`` (file name -> state dict, the
        model's with its parameters as such: its buffers are told apart) begins -- its buffers'
        values taken now, on their device. ``part``: only those (rank 0's own part for its
        peers), no copy of the rest to wait for."""
        states = split_buffers(tensors)
        held, live = {}, {}
        for name, state in states.items():
            if BUFFERS_SUFFIX in name:
                layout = Layout.of(state)
                held[name] = (layout, layout.gather())
            elif not part:
                live[name] = state
        device, start = _cuda_device(states), None
        if device is not None:
            import torch

            start = torch.cuda.Event()
            start.record(torch.cuda.current_stream(device))  # after the buffers' gather
        if not part:
            self._pending, self._device, self._done = True, device, None
            self._copied.clear()
        return Staged([n for n in states if n in held or n in live], live, held, device, start)

    def layouts(self, staged: Staged) -> dict[str, Layout]:
        """The background thread: where each file's tensors go (the weights' and the
        optimizer's walked now, before the optimizer may change its own dicts)."""
        return {
            name: staged.held[name][0] if name in staged.held else Layout.of(staged.live[name])
            for name in staged.order
        }

    def copy(
        self, staged: Staged, layouts: dict[str, Layout], buffers: dict[str, Any]
    ) -> dict[str, Flat]:
        """The background thread: every file copied into its ``buffers`` (uint8 CPU tensors
        of its layout's size). Returns once the copy has ended; from the moment nothing is
        left to queue the training thread's :meth:`settle` may return."""
        try:
            if staged.start is None:
                self._copy(staged, layouts, buffers, non_blocking=False)
            else:
                self._copy_on_side_stream(staged, layouts, buffers)
        finally:
            self.release()
            if self._done is not None:
                self._done.synchronize()  # this thread waits for the copy's end; the step not
        return {name: Flat.of(layouts[name], buffers[name]) for name in staged.order}

    def _copy(
        self,
        staged: Staged,
        layouts: dict[str, Layout],
        buffers: dict[str, Any],
        non_blocking: bool,
    ) -> None:
        for name in staged.order:
            if name in staged.held:
                layouts[name].place(buffers[name], staged.held[name][1], non_blocking)
            else:
                layouts[name].copy(buffers[name], non_blocking)

    def _copy_on_side_stream(
        self, staged: Staged, layouts: dict[str, Layout], buffers: dict[str, Any]
    ) -> None:
        import torch

        stream = self._side_stream(staged.device)
        with torch.cuda.stream(stream):
            stream.wait_event(staged.start)
            try:
                self._copy(staged, layouts, buffers, non_blocking=True)
            finally:  # whatever was queued, settle orders the optimizer's step after it
                self._done = stream.record_event()

    def held_copy(self, staged: Staged) -> dict[str, Flat]:
        """The background thread: the buffers ``begin(part=True)`` took, in new host memory."""
        import torch

        flats = {}
        for name, (layout, gathered) in staged.held.items():
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
            if staged.start is None:
                layout.place(buffer, gathered)
            else:
                stream = self._side_stream(staged.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(staged.start)
                    layout.place(buffer, gathered)  # into pageable memory: waited for
            flats[name] = Flat.of(layout, buffer)
        return flats

    def _side_stream(self, device: Any) -> Any:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def release(self) -> None:
        """The live state is no longer read (the copy ended, or never began: the snapshot was
        dropped): :meth:`settle` returns."""
        self._copied.set()

    def settle(self) -> float:
        """The training thread, before ``optimizer.step()``: returns once the copy begun last
        can no longer see the step's changes -- on a GPU once it is queued, the training
        stream then ordered after it (a wait of the device, timed); on the CPU once it has
        ended. The seconds this thread waited."""
        if not self._pending:
            return 0.0
        start = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - start
        self._pending = False
        if self._done is not None:
            import torch

            stream = torch.cuda.current_stream(self._device)
            before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            before.record(stream)
            stream.wait_event(self._done)
            after.record(stream)
            self._stalls.append((before, after))
        return waited

    def stalled(self) -> float:
        """Seconds the training stream waited for copies at :meth:`settle`, of the waits the
        device has passed since the last call."""
        passed = [after.query() for _, after in self._stalls]
        done = [pair for pair, ended in zip(self._stalls, passed, strict=True) if ended]
        self._stalls = [pair for pair, ended in zip(self._stalls, passed, strict=True) if not ended]
        return sum(before.elapsed_time(after) for before, after in done) / 1e3

    @property
    def measuring(self) -> bool:
        """A stream's wait the device has not passed yet: its length is not known."""
        return bool(self._stalls)


def _cuda_device(states: dict[str, Any]) -> Any:
    """The GPU a snapshot's state lies on (its first state dict's first tensor's), else None."""
    import torch

    for state in states.values():
        values = state.values() if isinstance(state, dict) else ()
        first = next((v for v in values if isinstance(v, torch.Tensor)), None)
        if first is not None:
            return first.device if first.is_cuda else None
    return None


__all__ = ["SnapshotCopy", "Staged"]
