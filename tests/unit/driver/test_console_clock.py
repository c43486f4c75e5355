"""The console's clock counts from the driver's start -- summary.json's ``timing.run_started``,
second 0 of timeline.png -- so a kill the console shows at 00:35 is at 35 s on the picture,
not ~20 s later, as when the console counted from its first poll of the ledger."""

from __future__ import annotations

import time
from typing import Any

import ray

from ftjob.driver.monitor import Monitor
from ftjob.reporting.loggers import LogFeed


class Ledger:
    """Answers the monitor's polls at once; ``poll`` gives ``lines`` once."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def __getattr__(self, name: str) -> Any:
        ledger = self

        class Method:
            def remote(self, *args: Any) -> Any:
                if name == "poll":
                    lines, ledger.lines = ledger.lines, []
                    return lines, len(lines)
                return {"check_watch": []}.get(name)

        return Method()


class Keeper:
    lost: str | None = None


def test_the_console_counts_from_the_drivers_start(monkeypatch) -> None:
    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    run_started = time.time() - 35  # the driver started 35 s ago (ray.init, preparation...)
    said: list[str] = []
    ledger = Ledger(["chaos: kill 1 (worker)"])
    monitor = Monitor(ledger, said.append, None, Keeper(), LogFeed([]), started=run_started)
    monitor.tick()  # the monitor started now, a poll later
    [line] = said
    clock, text = line.split(" ", 1)
    minutes, seconds = map(int, clock.split(":"))
    assert text == "chaos: kill 1 (worker)"
    assert minutes * 60 + seconds in (35, 36)  # whole seconds since the driver started
