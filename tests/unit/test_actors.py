"""ftjob.actors: calls to an actor run the method they name, and the type checker holds them to
that method's signature -- a call by attribute name, a wrong argument or another class's
method does not type-check (checked with mypy, as .ci/run runs it)."""

from __future__ import annotations

import pickle
import textwrap
import threading
from pathlib import Path

import pytest

from ftjob.actors import DirectHandle, answered, call, tell

ROOT = Path(__file__).resolve().parents[2]


class Counter:
    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def add(self, n: int, why: str = "") -> int:
        self.seen.append((n, why))
        return sum(k for k, _ in self.seen)


def test_tell_and_call_run_the_named_method_with_its_arguments():
    counter = Counter()
    handle = DirectHandle(counter)
    tell(handle, Counter.add, 2, why="first")
    assert answered(call(handle, Counter.add, 3)) == 5
    assert counter.seen == [(2, "first"), (3, "")]


def test_a_direct_handle_runs_one_call_at_a_time_and_pickles_with_its_object():
    counter = Counter()
    handle = DirectHandle(counter)
    threads = [threading.Thread(target=tell, args=(handle, Counter.add, 1)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(counter.seen) == 8
    copy = pickle.loads(pickle.dumps(handle))
    assert answered(call(copy, Counter.add, 0)) == 8  # the object came with it


def test_the_type_checker_holds_calls_to_the_actors_class(tmp_path: Path):
    api = pytest.importorskip("mypy.api")
    source = tmp_path / "calls.py"
    source.write_text(
        textwrap.dedent(
            """
            from typing import Protocol

            from ftjob.actors import Actor, ask, call, tell


            class Ledger:
                def poll(self, cursor: int) -> list[str]:
                    return []

                def log(self, line: str) -> None: ...


            class Killer:
                def stop(self) -> int:
                    return 0


            class Logs(Protocol):
                def log(self, line: str) -> None: ...


            def logs(actor: Actor[Logs]) -> None: ...


            def calls(ledger: Actor[Ledger], killer: Actor[Killer]) -> None:
                lines: list[str] = ask(ledger, Ledger.poll, 10, 3)
                tell(ledger, Ledger.log, "fine")
                logs(ledger)
                tell(ledger, Ledger.log, 3)  # wrong: a wrong argument
                call(ledger, Killer.stop)  # wrong: another class's method
                ledger.poll.remote(3)  # wrong: a call by name
                logs(killer)  # wrong: an actor without those methods
                count: int = ask(ledger, Ledger.poll, 10, 3)  # wrong: a wrong answer type
            """
        )
    )
    wrong = [n for n, line in enumerate(source.read_text().splitlines(), 1) if "# wrong" in line]
    # The project's settings, and its cache of ftjob's and its libraries' types
    args = [str(source), "--config-file", str(ROOT / "pyproject.toml")]
    out, _, status = api.run([*args, "--cache-dir", str(ROOT / ".mypy_cache")])
    flagged = sorted({int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line})
    assert status == 1 and flagged == wrong and len(wrong) == 5, out
