"""Preemption notices, as the training workers see them.

A notice comes from Ray Train (a node of the run is being drained: a spot reclaim, an
autoscaler, ``chaos=preempt``; Ray's watcher marks every worker with the deadline), from the
driver (SIGTERM: Kubernetes, SLURM, ``ray job stop``) through the run ledger, or from SIGTERM
to a training worker process itself (a pod or a process supervisor stopping it). Each rank reads
its local signals without a barrier; once per step every rank agrees on them in one small
all-reduce (:meth:`PreemptionNotices.agree`), so all ranks stop at the same step and no rank
leaves alone. What the loop then does (a just-in-time checkpoint of that step, then waiting to
be torn down) is in :mod:`ftjob.worker.loop`.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftjob.ray_internals import preemption_info, ray_exit_handler, set_ray_exit_handler
from ftjob.record import JitCheckpoint, NoticeSource
from ftjob.record import Notice as NoticeRecord

DRAIN, DRIVER, WORKER = NoticeSource.drain, NoticeSource.driver, NoticeSource.worker
RESIZE = NoticeSource.resize  # not a preemption: the elastic group is about to be resized
# The agreed kind is the highest any rank saw: a real preemption outranks a planned resize.
SOURCES = {1: RESIZE, 2: DRAIN, 3: DRIVER, 4: WORKER}
_KIND = {source: kind for kind, source in SOURCES.items()}


@dataclass(frozen=True)
class Notice:
    """An agreed preemption notice."""

    source: NoticeSource
    deadline: float | None  # UNIX seconds the node goes away; None if not announced
    received: float  # when this rank saw it agreed

    def remaining(self, now: float) -> float:
        return math.inf if self.deadline is None else self.deadline - now

    def record(self, step: int, ranks: list[int], validation_cut: int | None) -> NoticeRecord:
        """What the run ledger keeps of it: also the step it came at, the ranks a drain
        named, and a validation it cut short."""
        return NoticeRecord(
            source=self.source,
            received=self.received,
            step=step,
            deadline=self.deadline,
            ranks=tuple(ranks),
            validation_cut=validation_cut,
        )


def ray_drain_notice() -> tuple[float | None, list[int]] | None:
    """(deadline in UNIX seconds or None, preempted ranks) if Ray Train marked this worker
    preempted, read locally (``ray.train.get_preemption_info`` is a barrier per call)."""
    info = preemption_info()
    if info is None:
        return None
    deadline = info.deadline_ms / 1000.0 if info.deadline_ms else None
    return deadline, list(info.preempted_ranks)


class PreemptionNotices:
    """Local notice signals of one rank, and the per-step agreement across ranks."""

    def __init__(
        self,
        world: int,
        device: Any,
        recorder: Any = None,
        poll_s: float = 0.5,
        sigterm: bool = False,
        drain_notice: Callable[[], tuple[float | None, list[int]] | None] | None = None,
    ) -> None:
        """``recorder`` (rank 0's :class:`~ftjob.worker.recorder.RunRecorder`): polled for the
        driver's requests; ``drain_notice``: Ray Train's mark of a draining node, read
        locally; ``sigterm``: SIGTERM to this process becomes a notice (through Ray's handler)."""
        self.world, self.device, self.drain_notice = world, device, drain_notice
        self._ray_exit: Any = None
        self.requested = threading.Event()  # the driver asked (through the ledger)
        self.requested_source = DRIVER  # or RESIZE: the elastic group is about to be resized
        self.terminated = threading.Event()  # this worker process got SIGTERM
        self.drain_ranks: list[int] = []
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if recorder is not None:
            self._poller = threading.Thread(
                target=self._poll, args=(recorder, poll_s), name="ftjob-notice", daemon=True
            )
            self._poller.start()
        if sigterm:
            self.catch_sigterm()

    def _poll(self, recorder: Any, poll_s: float) -> None:
        import ray.exceptions

        while not self._stop.wait(poll_s):
            try:
                source = recorder.notice_request()
            except (ray.exceptions.RayError, TimeoutError):  # the run is ending anyway
                return
            if source is not None:
                self.requested_source = source
                self.requested.set()
                return

    def local(self) -> tuple[int, float]:
        """(0 none, or the kind of :data:`SOURCES`; deadline or +inf) as this rank sees it."""
        if self.terminated.is_set():
            return _KIND[WORKER], math.inf
        drain = self.drain_notice() if self.drain_notice is not None else None
        if drain is not None:
            deadline, self.drain_ranks = drain
            return _KIND[DRAIN], deadline if deadline is not None else math.inf
        if self.requested.is_set():
            return _KIND[self.requested_source], math.inf
        return 0, math.inf

    def noticed(self) -> bool:
        """A notice reached this rank (no agreement: for cutting work short)."""
        return self.local()[0] != 0

    def agree(self) -> Notice | None:
        """Called by every rank at the same point of every step."""
        kind, deadline = self.local()
        if self.world > 1:
            import torch
            import torch.distributed as dist

            # On the training device: NCCL reduces only CUDA tensors.
            box = torch.tensor([float(kind), -deadline], dtype=torch.float64, device=self.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)  # any rank's notice, earliest deadline
            kind, deadline = int(box[0].item()), -float(box[1].item())
        if kind == 0:
            return None
        return Notice(SOURCES[kind], None if math.isinf(deadline) else deadline, time.time())

    def catch_sigterm(self) -> None:
        """Make SIGTERM to this worker process a notice. Ray's handler (on the process's main
        thread; training runs on another, which cannot install one) would exit at once: the
        message it exits with is taken over while a notice can still be acted on."""
        self._ray_exit = original = ray_exit_handler()

        def on_exit(message: str, exit_code: int = 1) -> None:
            if "SIGTERM" in message and not self.terminated.is_set() and not self._stop.is_set():
                self.terminated.set()  # the first one, while training: a notice
                return
            original(message, exit_code)

        set_ray_exit_handler(on_exit)

    def wait_for_teardown(self, teardown: Callable[[], None]) -> None:
        """After the just-in-time checkpoint: a worker that got SIGTERM now exits as Ray would
        have (Ray Train restarts the group); the others wait to be stopped (``teardown``) --
        returning would tell Ray Train that training finished."""
        self.close()
        if self.terminated.is_set():
            os.kill(os.getpid(), signal.SIGTERM)  # Ray's own handler, this time
        teardown()

    def close(self) -> None:
        self._stop.set()
        if self._ray_exit is not None:
            set_ray_exit_handler(self._ray_exit)
            self._ray_exit = None


def describe_jit(jit: JitCheckpoint) -> str:
    """The progress line of the just-in-time checkpoint after a notice."""
    if not jit.path:
        return f"no just-in-time checkpoint: {jit.reason}"
    how = "already committed" if jit.reused else f"in {jit.seconds:.2f}s"
    return f"just-in-time checkpoint of step {jit.step} {how}: 0 steps will be lost"


def describe_notice(notice: NoticeRecord) -> list[str]:
    """Progress lines for a notice every rank agreed on."""
    if notice.source == RESIZE:
        return [
            f"resizing from {notice.from_} to {notice.to} workers at step "
            f"{notice.step}: saving a just-in-time checkpoint first"
        ]
    deadline = notice.deadline
    left = f"{deadline - notice.received:.0f} s before the deadline" if deadline else "no deadline"
    lines = [
        f"preemption notice ({notice.source}) at step {notice.step}, {left}: "
        "saving a just-in-time checkpoint"
    ]
    if notice.validation_cut is not None:
        lines.append(
            f"validation at step {notice.validation_cut} was cut short by the notice; "
            "it runs again after the restart"
        )
    return lines
