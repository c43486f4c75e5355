"""A training worker's heartbeat: which section it is in, when it last made progress, and how
long its steps take -- sent to the run ledger by a thread, about once a second.

The training thread only stamps local fields (no remote call per step). The heartbeat thread
sends them; a stopped process stops both, a deadlocked training thread leaves the thread
beating with a progress time that no longer moves -- the ledger (:mod:`ftjob.policy.hang`) tells the
two apart. Progress ages, not wall-clock times, travel, so clock skew between nodes does not
matter.

A rank's *local* step time is its batch wait plus its compute up to the moment its last
gradient bucket is ready to be all-reduced (a DDP communication hook stamps it), so time spent
waiting for slower ranks is not counted: it scores stragglers. ``chaos=slow`` makes a rank
sleep a fraction of its own local step time, between forward and backward.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ftjob.record import Beat

logger = logging.getLogger("ftjob.worker.heartbeat")


class Heartbeat:
    def __init__(
        self,
        recorder: Any,
        io_count: Any = None,
        interval: float = 1.0,
        enabled: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        settle_steps: int = 0,
    ) -> None:
        self.recorder, self.sleep = recorder, sleep  # a RunRecorder: where beats go
        self.io_count = io_count or (lambda: -1)  # storage requests completed so far
        self.interval = interval
        # The attempt's first steps share the process with start-up (the stream's first decode
        # window, allocator and kernel warm-up): progress, but not what a step takes.
        self.settle_steps, self._steps = settle_steps, 0
        self._lock = threading.Lock()
        now = time.perf_counter()
        self.current, self.entered, self.progress = "setup", now, now
        self.step = 0
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.local: list[float] = []
        self.slow = 0.0  # chaos=slow: the fraction of its local step time this rank sleeps
        self._pace: deque[float] = deque(maxlen=21)  # recent local step times, less the sleep
        self._step_start = self._ready = self._slept = 0.0
        self._waited = 0.0
        self._computing = False  # between a batch's arrival and the step's end
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if enabled:
            self._thread = threading.Thread(target=self._run, name="ftjob-heartbeat", daemon=True)
            self._thread.start()

    # -- the training thread ------------------------------------------------------------

    def enter(self, section: str) -> None:
        """A new section starts now (the one left counts as done)."""
        now = time.perf_counter()
        with self._lock:
            if self.current not in ("step", section):
                self.durations[self.current].append(now - self.entered)
            self.current, self.entered, self.progress = section, now, now
        self._wake.set()  # the ledger learns a new section at once, not a heartbeat later

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        previous = self.current
        self.enter(name)
        try:
            yield
        finally:
            self.enter(previous)

    def step_started(self, waited: float) -> None:
        """The step's batch arrived (after ``waited`` seconds): progress, and the end of the
        rank's wait for data -- a section of its own, with its own learned timeout."""
        now = time.perf_counter()
        self._step_start, self._waited, self._ready = now, waited, 0.0
        self._slept = 0.0
        with self._lock:
            if self.current == "step":
                self.durations["data"].append(waited)
                self.progress = now
            self._computing = True

    def straggle(self) -> None:
        """chaos=slow: sleep ``slow`` times this rank's current local step time (the median of
        its recent steps, each less what it slept -- its pace now, not at the run's start,
        whose first steps share the process with the stream's start-up)."""
        if self.slow > 0 and self._pace:
            self._slept = self.slow * statistics.median(self._pace)
            self.sleep(self._slept)

    def step_done(self, step: int) -> None:
        now = time.perf_counter()
        ready = self._ready if self._ready > self._step_start else now
        local = self._waited + ready - self._step_start
        with self._lock:
            if self.current == "step":
                self._steps += 1  # steps after the warm-up one
                if self._steps > self.settle_steps:
                    # Its own compute, until its gradients were ready: not the wait for a
                    # slower rank in the all-reduce (that rank is timed in its own section).
                    self.durations["step"].append(ready - self._step_start)
                self.local.append(local)
                self._pace.append(local - self._slept)  # the rank's own pace: chaos=slow scales it
            else:  # the first step of an attempt ends its warm-up (its wait is no pace)
                self.durations[self.current].append(now - self.entered)
                self.current = "step"
            self._computing = False
            self.step, self.progress = step, now

    def attach(self, model: Any) -> None:
        """Stamp when this rank's gradients are ready, before DDP all-reduces them."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # DDP refuses annotations that are not its own objects (this module's are strings):
        # the hook's types are a comment.
        def stamped(state, bucket):  # noqa: ANN001, ANN202
            # type: (Any, Any) -> Any
            self.gradients_ready()
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, stamped)

    def gradients_ready(self) -> None:
        """This rank's gradients are computed: its step's own compute ends here, before it
        waits for the others (DDP's hook, or exact mode's sum)."""
        self._ready = time.perf_counter()

    def close(self) -> None:
        self._stop.set()
        self.enter("done")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._send()  # the last durations

    # -- the heartbeat thread -----------------------------------------------------------

    def _beat(self) -> Beat:
        with self._lock:
            waiting = self.current == "step" and not self._computing
            section = "data" if waiting else self.current
            age = time.perf_counter() - self.progress
            step, durations, local = self.step, dict(self.durations), self.local
            self.durations, self.local = defaultdict(list), []
        return Beat(section, age, step, durations, local, io=self.io_count())

    def _send(self) -> None:
        import ray.exceptions

        try:
            answer = self.recorder.heartbeat(self._beat())
        except (ray.exceptions.RayError, TimeoutError, ConnectionError) as exc:
            logger.debug("heartbeat not delivered: %s", exc)
            return
        self.slow = float(answer)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._send()
