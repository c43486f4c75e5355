"""The driver's side of a running job, on its main thread: the progress lines, the duties each
poll of the run ledger serves (hang and straggler handling, node replacement, the lease, the
run's record held on the driver's side), and what SIGTERM means before and after training
started."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ftjob import actors
from ftjob.actors import Actor, tell
from ftjob.driver.held_record import HeldRecord
from ftjob.driver.ledger import RunLedger, empty_snapshot
from ftjob.record import Hang, RunSnapshot, StackCapture, Straggler
from ftjob.reporting.loggers import LogFeed
from ftjob.reporting.outputs import COMMIT_LINE, OutputsMirror
from ftjob.storage.lease import LeaseKeeper
from ftjob.text import shorten

logger = logging.getLogger("ftjob")


class StoppedDuringStartUp(BaseException):
    """SIGTERM before training started: nothing to checkpoint yet; the run stops with its
    summary (a BaseException, like KeyboardInterrupt, so no handler of errors swallows it)."""


class StopSignal:
    """SIGTERM to the driver (Kubernetes, SLURM, ``ray job stop``). During start-up it stops
    the run (``stage`` says where it was); once training started it is a preemption notice:
    forwarded to the workers through the ledger; the run stops once their just-in-time
    checkpoint is recorded, or after ``wait_s``."""

    def __init__(self, enabled: bool, wait_s: float = 60.0) -> None:
        self.received: float | None = None
        self.enabled, self.wait_s = enabled, wait_s
        self.stage = "checking the storage, the resume target and the dataset"
        self.training = False
        self._installed = False
        self._previous: Any = None
        self.install()

    def install(self) -> None:
        """Handle SIGTERM here -- again after ``ray.init``, which installs a handler of its own
        in the driver. Only the main thread may handle signals (runner.run called from another
        thread: SIGTERM keeps its default)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        if not self._installed:
            self._previous, self._installed = previous, True

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.enabled:  # failure.preemption=false: stop as on Ctrl-C, with a summary
            raise KeyboardInterrupt
        if not self.training:
            raise StoppedDuringStartUp
        if self.received is None:
            self.received = time.time()

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False

    def done(self, ledger: Actor[RunLedger], echo: Callable[[str], None]) -> bool:
        """Called every poll: True when the run should stop now."""
        if self.received is None:
            return False
        if not actors.ask(ledger, RunLedger.stop_requested, 10):
            echo("SIGTERM: a preemption notice; committing a checkpoint of the current step")
            tell(ledger, RunLedger.request_stop, "SIGTERM", self.received)
        latest = actors.ask(ledger, RunLedger.latest_preemption, 10)
        checkpointed = latest is not None and latest.jit is not None
        return checkpointed or time.time() - self.received > self.wait_s


class Monitor:
    """Prints the ledger's progress lines, ends a hung (or, if so configured, straggling)
    worker the ledger found, replaces killed nodes of a local cluster, watches the lease, and
    keeps the run's record on the driver's side (``held``: pulled every few seconds and at
    every committed checkpoint). Each duty asks the ledger on its own: one that fails is
    said, and the others go on. A line's ``mm:ss`` counts from ``started``: the driver's
    start, summary.json's ``timing.run_started`` -- second 0 of timeline.png too."""

    def __init__(
        self,
        ledger: Actor[RunLedger],
        echo: Callable[[str], None],
        local: Any,
        keeper: LeaseKeeper,
        feed: LogFeed,
        clean: Callable[[str], str] = lambda text: text,
        outputs: OutputsMirror | None = None,
        held: HeldRecord | None = None,
        started: float | None = None,
    ) -> None:
        self.ledger, self.echo, self.local, self.keeper = ledger, echo, local, keeper
        self.feed, self.clean, self.outputs = feed, clean, outputs
        self.held = held or HeldRecord(empty_snapshot())
        self.cursor = 0
        self.started = time.time() if started is None else started
        self.failing: dict[str, int] = {}  # duty -> failed asks in a row
        self.unanswered: str | None = None  # the ledger's last error: why it did not answer

    def ask(self, duty: str, call: Callable[[], Any]) -> Any:
        """``call()`` (which asks the ledger); None when the ledger did not answer, said at
        the first failure of a streak and every minute of it."""
        import ray

        try:
            value = call()
        except (ray.exceptions.RayError, TimeoutError, ConnectionError) as exc:
            count = self.failing[duty] = self.failing.get(duty, 0) + 1
            first = shorten((str(exc).strip().splitlines() or [""])[0], 200)
            self.unanswered = f"{type(exc).__name__}: {first}"
            if count == 1 or count % 60 == 0:
                self.echo(
                    f"warning: the run ledger did not answer ({duty}; {count} time(s) in a row): "
                    f"{type(exc).__name__}: {first}"
                )
            return None
        if self.failing.pop(duty, 0):
            self.echo(f"the run ledger answers again ({duty})")
        return value

    def tick(self) -> bool:
        """One round of duties. False when this driver lost its run to another driver."""
        import ray

        ledger, lost = self.ledger, self.keeper.lost
        if lost is not None:
            self.echo(f"stopping: {lost}")
            self.ask("lease lost", lambda: tell(ledger, RunLedger.set_fatal, lost))
            return False
        polled = self.ask("progress", lambda: actors.ask(ledger, RunLedger.poll, 10, self.cursor))
        lines: list[str] = []
        if polled is not None:
            lines, self.cursor = [self.clean(line) for line in polled[0]], polled[1]
        for line in lines:
            elapsed = int(time.time() - self.started)
            self.echo(f"{elapsed // 60:02d}:{elapsed % 60:02d} {line}")
        committed = any(COMMIT_LINE.match(line) for line in lines)
        if committed or self.held.due(time.time()):
            self.pull("record")
        if self.outputs is not None and committed:
            self.outputs.request()  # a durable point: the mirror catches up, on its thread
        if self.feed.loggers:
            records = self.ask(
                "loggers", lambda: actors.ask(ledger, RunLedger.log_feed, 10, self.feed.cursor)
            )
            if records is not None:
                self.feed.records(records)
            self.feed.events(lines, time.time())
        actions = self.ask(
            "hang detection", lambda: actors.ask(ledger, RunLedger.check_watch, 10, time.time())
        )
        for action in actions or []:
            self._end_stalled(action)
        if self.local is not None:
            answer = self.ask(
                "node replacement",
                lambda: ray.get(
                    [
                        actors.call(ledger, RunLedger.snapshot_kills),
                        actors.call(ledger, RunLedger.steps_trained),
                    ],
                    timeout=10,
                ),
            )
            if answer is not None:
                kills, trained = answer
                self.local.service(kills, time.time(), trained)
        return True

    def pull(self, duty: str, timeout: float = 10) -> bool:
        """The ledger's record since the last pull, into the held record (and its file)."""
        ledger, cursor = self.ledger, self.held.cursor
        pulled = self.ask(duty, lambda: actors.ask(ledger, RunLedger.pull, timeout, cursor))
        if pulled is not None:
            self.held.take(pulled, time.time())
        return pulled is not None

    def final_snapshot(self, ray_died: str | None = None) -> RunSnapshot:
        """The ledger's record of the run; if the ledger is gone (``ray_died``: with Ray, and
        why), the record the driver holds -- at most a few seconds old --, saying why it
        ends there (the run is then failed; its checkpoints are in storage)."""
        if ray_died is None and self.pull("final record", timeout=30):
            return self.held.record()
        pulled = self.held.pulled
        age = f"{time.time() - pulled:.0f} s old" if pulled is not None else "empty"
        why = ray_died or (
            f"the run ledger died before the run ended ({self.unanswered}); its record is the "
            f"driver's copy ({age}); the committed checkpoints are in storage"
        )
        return self.held.record(why)

    def _end_stalled(self, action: Hang | Straggler) -> None:
        """Capture a hung worker's stack and kill it (Ray Train restarts the group)."""
        import ray

        from ftjob.driver.stacks import end_stalled_worker

        try:
            result = end_stalled_worker(action)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # its node went meanwhile
            result = StackCapture(pid=action.pid or 0, error=f"{type(exc).__name__}: {exc}")
        if isinstance(action, Hang):
            tell(self.ledger, RunLedger.hang_handled, action.time, result)
