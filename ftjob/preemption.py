"""Preemption notices, as the training workers see them.

A notice comes from Ray Train (a node of the run is being drained: a spot reclaim, an
autoscaler, ``chaos=preempt``; Ray's watcher marks every worker with the deadline) or from the
driver (SIGTERM: Kubernetes, SLURM, ``ray job stop``), through the run ledger. Each rank reads
its local signals without a barrier; once per step every rank agrees on them in one small
all-reduce (:meth:`PreemptionNotices.agree`), so all ranks stop at the same step and no rank
leaves alone. What the loop then does (a just-in-time checkpoint of that step, then waiting to
be torn down) is in ``train_loop.py``.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

DRAIN, DRIVER = "drain", "driver"


@dataclass(frozen=True)
class Notice:
    """An agreed preemption notice."""

    source: str  # DRAIN (Ray Train saw a node drain) | DRIVER (the driver got SIGTERM)
    deadline: float | None  # UNIX seconds the node goes away; None if not announced
    received: float  # when this rank saw it agreed

    def remaining(self, now: float) -> float:
        return math.inf if self.deadline is None else self.deadline - now

    def record(self, step: int, ranks: list[int]) -> dict[str, Any]:
        """What the run ledger keeps of it."""
        return {
            "source": self.source,
            "deadline": self.deadline,
            "received": self.received,
            "step": step,
            "ranks": ranks,
        }


def ray_drain_notice() -> tuple[float | None, list[int]] | None:
    """(deadline in UNIX seconds or None, preempted ranks) if Ray Train marked this worker
    preempted, read locally (``ray.train.get_preemption_info`` is a barrier per call)."""
    from ray.train.v2._internal.execution.context import get_train_context

    info = get_train_context().preemption_context.preemption_info
    if info is None:
        return None
    deadline = info.deadline_ms / 1000.0 if info.deadline_ms else None
    return deadline, list(info.preempted_ranks)


class PreemptionNotices:
    """Local notice signals of one rank, and the per-step agreement across ranks."""

    def __init__(self, world: int, device: Any, ledger: Any = None, poll_s: float = 0.5) -> None:
        self.world, self.device = world, device
        self.requested = threading.Event()  # the driver asked (through the ledger)
        self.drain_ranks: list[int] = []
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if ledger is not None:
            self._poller = threading.Thread(
                target=self._poll_ledger, args=(ledger, poll_s), name="ftjob-notice", daemon=True
            )
            self._poller.start()

    def _poll_ledger(self, ledger: Any, poll_s: float) -> None:
        import ray

        while not self._stop.wait(poll_s):
            try:
                if ray.get(ledger.stop_requested.remote(), timeout=10):
                    self.requested.set()
                    return
            except ray.exceptions.RayError:  # the ledger is gone: the run is ending anyway
                return

    def local(self) -> tuple[int, float]:
        """(0 none | 1 drain | 2 driver, deadline or +inf) as this rank sees it now."""
        drain = ray_drain_notice()
        if drain is not None:
            deadline, self.drain_ranks = drain
            return 1, deadline if deadline is not None else math.inf
        return (2, math.inf) if self.requested.is_set() else (0, math.inf)

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
        return Notice(
            DRAIN if kind == 1 else DRIVER,
            None if math.isinf(deadline) else deadline,
            time.time(),
        )

    def close(self) -> None:
        self._stop.set()
