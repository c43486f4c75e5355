"""The run ledger's requests to the running group: stop (a notice to the driver), and a
planned resize, from the scaling policy's request through the workers' checkpoint to the
resize carried out."""

from __future__ import annotations

from collections.abc import Callable

from ftjob.config.choices import Choice
from ftjob.record import Attempt, NoticeSource, ResizeRequest, StopRequest


class ResizeState(Choice):
    """Where the resize asked now stands (as Ray Train's controller names its states)."""

    none = "none"  # nothing asked
    requested = "requested"  # the workers are to checkpoint their step at the next notice poll
    notified = "notified"  # every rank agreed on the resize notice; the checkpoint is going
    checkpointed = "checkpointed"  # the checkpoint committed (or failed: it was tried)


class Requests:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.stop: StopRequest | None = None
        self.resize: ResizeRequest | None = None
        self.executed: list[float] = []  # when each planned resize was handed to Ray Train
        self._said: tuple[int, int] | None = None

    def request_stop(self, reason: str, now: float) -> bool:
        """True the first time: the workers checkpoint their current step, then stop."""
        if self.stop is not None:
            return False
        self.stop = StopRequest(reason=reason, time=now)
        self.log(f"preemption notice ({reason}): checkpointing the current step, then stopping")
        return True

    def request_resize(self, current: int, target: int, now: float) -> None:
        """The elastic scaling policy will resize the running group: the workers first commit a
        checkpoint of their current step (the preemption path), so the resize loses nothing."""
        if self.resize is not None:
            return
        self.resize = ResizeRequest(from_=current, to=target, requested=now)
        if self._said != (current, target):  # the policy asks again until served
            self._said = (current, target)
            self.log(f"capacity for {target} workers (running on {current}): resizing")

    def notice(self) -> NoticeSource | None:
        """What rank 0's notice poller acts on: a stop (SIGTERM to the driver), a resize."""
        if self.stop is not None:
            return NoticeSource.driver
        return NoticeSource.resize if self.resize is not None else None

    def served(self) -> None:
        """A new worker group started: the resize asked (if any) was served."""
        self.resize = None

    def executed_now(self, now: float) -> None:
        self.executed.append(now)
        self.resize = None  # served; a later request is a new one, and is said
        self._said = None

    def resize_state(self, latest: Attempt | None) -> ResizeState:
        asked = self.resize
        if asked is None:
            return ResizeState.none
        notice = latest.resize if latest is not None else None
        if notice is None or notice.requested != asked.requested:
            return ResizeState.requested  # (a notice for an earlier request is not this one's)
        return ResizeState.notified if notice.jit is None else ResizeState.checkpointed
