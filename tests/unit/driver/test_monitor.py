"""The driver's monitor: each duty asks the ledger on its own, a failing one is said and the
others go on, and a lost lease stops the run (no Ray: the ledger is a fake)."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from ftjob.driver.monitor import Monitor as _Monitor
from ftjob.reporting.loggers import LogFeed


class Ledger:
    """Answers each call at once; the calls named in ``down`` raise as a dead actor would."""

    def __init__(self, down: set[str]) -> None:
        self.down, self.calls = down, []

    def __getattr__(self, name: str) -> Any:
        ledger = self

        class Method:
            def remote(self, *args: Any) -> Any:
                ledger.calls.append(name)
                if name in ledger.down:
                    raise ray.exceptions.RayActorError()
                answers = {
                    "poll": ([], 0),
                    "check_watch": [],
                    "snapshot_kills": [],
                    "steps_trained": (),
                }
                return answers.get(name)

        return Method()


class Keeper:
    lost: str | None = None


class Cluster:
    def __init__(self) -> None:
        self.serviced = 0

    def service(self, kills: list[Any], now: float, trained: tuple[int, ...]) -> None:
        self.serviced += 1


@pytest.fixture(autouse=True)
def _no_object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)


def test_a_failing_progress_poll_is_said_once_and_stops_no_other_duty() -> None:
    ledger, said, cluster = Ledger({"poll"}), [], Cluster()
    monitor = _Monitor(ledger, said.append, cluster, Keeper(), LogFeed([]))
    for _ in range(3):
        assert monitor.tick()
    warnings = [line for line in said if "did not answer (progress" in line]
    assert len(warnings) == 1 and "RayActorError" in warnings[0]
    assert ledger.calls.count("check_watch") == 3  # hang detection goes on
    assert cluster.serviced == 3  # and so does node replacement
    ledger.down.clear()
    monitor.tick()
    assert said[-1] == "the run ledger answers again (progress)"


def test_a_lost_lease_stops_the_run_and_tells_the_ledger() -> None:
    ledger, said, keeper = Ledger(set()), [], Keeper()
    monitor = _Monitor(ledger, said.append, None, keeper, LogFeed([]))
    assert monitor.tick()
    keeper.lost = "run 'r' is now held by another driver (host-b:200, lease generation 2)"
    assert not monitor.tick()
    assert said[-1] == f"stopping: {keeper.lost}" and ledger.calls[-1] == "set_fatal"


def test_a_lost_ledger_leaves_a_record_that_says_so() -> None:
    monitor = _Monitor(Ledger({"pull"}), [].append, None, Keeper(), LogFeed([]))
    snapshot = monitor.final_snapshot()
    assert snapshot.attempts == () and "run ledger died" in (snapshot.fatal or "")
    assert "RayActorError" in (snapshot.fatal or "") and "driver's copy (empty)" in snapshot.fatal
