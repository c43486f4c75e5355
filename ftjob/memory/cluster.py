"""The memory tier on a cluster: a snapshot holder on every node that runs training ranks.

Each node's holder (:class:`~ftjob.memory.holder.NodeHolder`) is a Ray actor pinned to
that node, and the node's local rank 0 writes its snapshots into that holder's shared-memory
ring: the state DDP keeps identical on every rank never crosses the network per snapshot, and
every node holds a full copy, so the loss of any one node leaves the others'. A restarted rank
reads its own node's copy, else fetches the one rank 0 chose from a surviving peer (one
transfer), else the run restores from storage.

The holders are detached actors named by the run's identity (:mod:`ftjob.storage.identity`: its
name *and* its storage) -- namespace ``ftjob.<name>@<key>``, name ``holder.<node id>`` -- so
they outlive the driver: the next driver of the run (``resume=true``, or ``resume=auto`` on a
cluster that lived on) finds them by name and restores from them, and another run of the same
name with other storage never sees them. The
driver claims them while it runs and releases them when the run ends; a holder no driver claimed
for ``checkpoint.memory.orphan_timeout_s`` releases itself. A holder on a node that joins later
(an elastic grow, a replaced node) is created by the first rank that runs there. A driver fences
every holder it finds with its lease generation before its workers start
(:mod:`ftjob.memory.fence`): the previous driver's workers, should they outlive it,
write nothing the run restores from after that.

:class:`RunHolders` finds them on Ray; :class:`LocalHolders` is the same directory of plain
holders (the in-process harness, tests).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ftjob.actors import call, kill, tell
from ftjob.memory.fence import Refused
from ftjob.memory.holder import HolderHandle, NodeHolder, SnapshotHolder
from ftjob.storage.identity import RunIdentity

if TYPE_CHECKING:
    from ray import ObjectRef

RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # a run name, as ftjob.config checks it
NODE_ID = re.compile(r"[0-9A-Za-z_.-]+")
HOLDER_PREFIX = "holder."


class HolderDirectory(Protocol):
    """Where a run's holders are: this node's (created when it has none), and the others'."""

    def local(self, node_id: str) -> HolderHandle | None: ...

    def peers(self, node_id: str) -> list[tuple[str, HolderHandle]]: ...


def holder_namespace(run: RunIdentity) -> str:
    """The Ray namespace of a run's holders: its name (checked again here: it names actors,
    never a path) and its key, which no name can imitate (a name holds no ``@``)."""
    if not RUN_NAME.fullmatch(run.name):
        raise ValueError(
            f"run name {run.name!r}: letters, digits and ._- only, not starting with '.'"
        )
    return f"ftjob.{run.label}"


def holder_name(node_id: str) -> str:
    if not NODE_ID.fullmatch(node_id):
        raise ValueError(f"node id {node_id!r} is not a Ray node id")
    return HOLDER_PREFIX + node_id


@dataclass(frozen=True)
class RunHolders:
    """The holders of run ``run`` on the Ray cluster this process is connected to: what the
    driver hands every worker (plain values: it pickles)."""

    run: RunIdentity
    cap_bytes: int
    keep: int
    orphan_timeout_s: float

    @property
    def namespace(self) -> str:
        return holder_namespace(self.run)

    def local(self, node_id: str) -> HolderHandle:
        """The holder of ``node_id``, created there (pinned, detached) if it has none."""
        import ray

        from ftjob.placement import pinned_to

        # Ray's types give the handle as a union with the class itself (for its own decorators)
        actor: Any = ray.remote(num_cpus=0, max_restarts=0)(NodeHolder)
        return actor.options(
            name=holder_name(node_id),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(node_id),
        ).remote(self.cap_bytes, self.keep, self.orphan_timeout_s)

    def held(self) -> dict[str, HolderHandle]:
        """Node id -> handle of every live holder of the run."""
        import ray

        found: dict[str, HolderHandle] = {}
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = actor["name"]
            if actor["namespace"] == self.namespace and name.startswith(HOLDER_PREFIX):
                try:
                    found[name.removeprefix(HOLDER_PREFIX)] = ray.get_actor(name, self.namespace)
                except ValueError:  # gone since it was listed
                    continue
        return found

    def peers(self, node_id: str) -> list[tuple[str, HolderHandle]]:
        return sorted(((n, h) for n, h in self.held().items() if n != node_id), key=_first)

    def start(self, node_ids: list[str]) -> None:
        """The driver's start: a holder on each of ``node_ids`` (a node that joins later gets
        its own from its first rank)."""
        for node_id in node_ids:
            self.local(node_id)

    def fence(self, generation: int, timeout_s: float = 30.0) -> FenceOutcome:
        """Every holder of the run told that lease ``generation`` holds it (before the
        workers start). Those that refused it (they know a newer generation: this driver may
        be deposed -- the caller checks its lease, :meth:`drop`), and those that could not be
        fenced -- gone, silent, or of an older ftjob without a fence -- which are released: a
        holder that might take a deposed driver's snapshots is never read."""
        import ray
        import ray.exceptions

        asked: dict[str, tuple[HolderHandle, ObjectRef[Refused | None] | None]] = {}
        outcome = FenceOutcome()
        for node, handle in self.held().items():
            try:
                asked[node] = (handle, call(handle, SnapshotHolder.fence, generation))
            except AttributeError:  # a holder of an older ftjob: no fence
                asked[node] = (handle, None)
                outcome.released[node] = "it has no fence (an older ftjob)"
        for node, (handle, ref) in asked.items():
            try:
                answer = ray.get(ref, timeout=timeout_s) if ref is not None else None
            except (ray.exceptions.RayError, TimeoutError) as exc:  # gone, or silent
                outcome.released[node], answer = f"{type(exc).__name__}: {exc}", None
            if isinstance(answer, Refused):
                outcome.refused[node] = answer.reason
            elif node in outcome.released:
                kill(handle)
        return outcome

    def configure(self, generation: int | None, timeout_s: float = 30.0) -> list[dict[str, float]]:
        """Every holder of the run takes this driver's settings (one that outlived the last
        driver keeps those it was made with until told: a holder is made once per node and
        run, ``get_if_exists``). The settings before of each that had others; a holder that
        does not answer, or refuses (a newer driver fenced it), keeps its own."""
        import ray
        import ray.exceptions

        asked = []
        settings = self.cap_bytes, self.keep, self.orphan_timeout_s, generation
        for handle in self.held().values():
            try:
                asked.append(call(handle, SnapshotHolder.configure, *settings))
            except AttributeError:  # a holder of an older ftjob: it keeps its own
                continue
        before = []
        for ref in asked:
            try:
                answer = ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError):
                continue  # gone, or silent: its orphan time ends it
            if isinstance(answer, dict):
                before.append(answer)
        return before

    def drop(self, nodes: list[str], timeout_s: float = 30.0) -> list[str]:
        """These nodes' holders released now (one that refused a driver whose lease holds),
        and gone by name once this returns (up to ``timeout_s``): a rank's first call there
        makes a new one. The nodes whose holder is still there after that."""

        held = self.held()
        for node in nodes:
            if node in held:
                kill(held[node])
        deadline = time.monotonic() + timeout_s
        while (left := sorted(set(nodes) & set(self.held()))) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def claim(self) -> int:
        """The driver is alive: every holder of the run is kept. How many there are."""
        held = self.held()
        for handle in held.values():
            tell(handle, SnapshotHolder.claim)
        return len(held)

    def release(self, generation: int | None = None) -> int:
        """The run ended (or the run starts afresh): every holder goes -- with
        ``generation`` (the ending driver's lease), every holder but those fenced by a newer
        one, which another driver of the run holds now. How many went."""
        import ray
        import ray.exceptions

        held = self.held()
        if generation is not None:
            fences = {n: call(h, SnapshotHolder.stats) for n, h in held.items()}
            for node, ref in fences.items():
                try:
                    kept = (ray.get(ref, timeout=30.0).get("generation") or 0) > generation
                except (ray.exceptions.RayError, TimeoutError):
                    kept = True  # silent: it may be a newer driver's; its orphan time ends it
                if kept:
                    del held[node]
        for handle in held.values():
            kill(handle)
        return len(held)


@dataclass
class FenceOutcome:
    """What a driver's fence met: node id -> the reason of each holder that refused it, and of
    each that could not be fenced and was released."""

    refused: dict[str, str] = field(default_factory=dict)
    released: dict[str, str] = field(default_factory=dict)


@dataclass
class LocalHolders:
    """A directory of holders in one process or behind a manager's proxies: ``handles``, node
    id -> handle; ``make()``, a new node's holder (None: a node without one has none)."""

    handles: dict[str, HolderHandle] = field(default_factory=dict)
    make: Callable[[], HolderHandle] | None = None

    def local(self, node_id: str) -> HolderHandle | None:
        if node_id not in self.handles and self.make is not None:
            self.handles[node_id] = self.make()
        return self.handles.get(node_id)

    def peers(self, node_id: str) -> list[tuple[str, HolderHandle]]:
        return sorted(((n, h) for n, h in self.handles.items() if n != node_id), key=_first)

    def lose(self, node_id: str) -> None:
        """The node is gone, and its holder with it."""
        self.handles.pop(node_id, None)


def _first(pair: tuple[str, HolderHandle]) -> str:
    return pair[0]


__all__ = [
    "FenceOutcome",
    "HolderDirectory",
    "LocalHolders",
    "RunHolders",
    "holder_name",
    "holder_namespace",
]
