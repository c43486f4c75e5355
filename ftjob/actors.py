"""Calls to ftjob's Ray actors, checked against the actor's class.

A Ray actor handle answers any attribute: ``ledger.pol.remote(cursor)`` is a typo only Ray
notices, at run time, and ``ledger.poll.remote("3")`` passes whatever it is given. Here a handle
is an :class:`Actor` of the class it runs (``Actor[RunLedger]``, what
:func:`ftjob.placement.start_pinned_actor` gives), and it is called through three functions that
name the method as an attribute of that class, not as a string::

    tell(ledger, RunLedger.kill, record)               # fire and forget
    ref = call(holder, SnapshotHolder.get, step, gen)  # the answer to come: ray.get or ray.wait it
    view = ask(ledger, RunLedger.chaos_view, 10)       # the answer, waited for (seconds)

so the type checker holds each call to the method's signature and the answer to its return type,
as :class:`~ftjob.worker.recorder.RunRecorder` holds the workers' calls to
:class:`~ftjob.record.WorkerLedger`. A function that needs only some of an actor's methods takes
an ``Actor`` of a Protocol that lists them (the chaos killer's view of the ledger): an
``Actor[RunLedger]`` is one wherever the ledger has those methods. A call by attribute
(``ledger.poll.remote()``) does not type-check.

In tests a :class:`DirectHandle` stands in for a Ray handle: the same calls run the object's
method at once, and what Ray would give as an ObjectRef is the answer itself (:func:`answered`
is the ``ray.get`` of such a handle).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from ray import ObjectRef

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")
R = TypeVar("R")


class ByName:
    """What an :class:`Actor`'s attribute is to the type checker: nothing to call. Its methods
    are called through :func:`tell`, :func:`call` and :func:`ask`."""


class Actor(Protocol[T_co]):
    """A handle on an actor that runs a ``T_co``: a Ray ActorHandle, or a :class:`DirectHandle`.
    Both answer any attribute (``__getattr__``); what they answer is typed as :class:`ByName`,
    so only the three typed calls reach the actor's methods."""

    def __getattr__(self, name: str) -> ByName: ...


Method = Callable[Concatenate[T, P], R]  # a method of the actor's class, named as its attribute


def tell(
    actor: Actor[T], method: Method[T, P, object], /, *args: P.args, **kwargs: P.kwargs
) -> None:
    """``method(*args, **kwargs)`` on the actor, its answer dropped (Ray runs an actor's calls
    from one caller in order)."""
    getattr(actor, method.__name__).remote(*args, **kwargs)


def call(
    actor: Actor[T], method: Method[T, P, R], /, *args: P.args, **kwargs: P.kwargs
) -> ObjectRef[R]:
    """``method(*args, **kwargs)`` on the actor: the ObjectRef of its answer."""
    return getattr(actor, method.__name__).remote(*args, **kwargs)


def ask(
    actor: Actor[T],
    method: Method[T, P, R],
    timeout: float | None,
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """``method(*args, **kwargs)`` on the actor: its answer, waited for ``timeout`` seconds at
    most (``ray.exceptions.GetTimeoutError`` past it; None: as long as it takes)."""
    import ray

    return ray.get(call(actor, method, *args, **kwargs), timeout=timeout)


def kill(actor: Actor[object]) -> None:
    """The actor ended now, its calls in flight with it (``ray.kill``: no restart)."""
    import ray

    handle: Any = actor  # a Ray ActorHandle: the only kind ended this way
    ray.kill(handle)


class Fetch(Protocol):
    """What turns an ObjectRef into its value: ``ray.get`` on Ray, :func:`answered` for a
    :class:`DirectHandle`'s calls."""

    def __call__(self, ref: ObjectRef[R], /, *, timeout: float | None = None) -> R: ...


def answered(ref: ObjectRef[R], /, *, timeout: float | None = None) -> R:
    """A :class:`DirectHandle`'s answer (or an object a test put in place of Ray's object
    store): the value itself, where Ray gives an ObjectRef."""
    return cast("R", ref)


class DirectHandle(Generic[T]):
    """A plain object behind the ``handle.method.remote(*args)`` calls a Ray actor handle
    takes: each call runs at once, under one lock (an actor runs one call at a time), and gives
    its answer itself."""

    def __init__(self, target: T) -> None:
        self._target, self._lock = target, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method, lock = getattr(self._target, name), self._lock

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                with lock:
                    return method(*args, **kwargs)

        return _Remote()

    def __getstate__(self) -> dict[str, Any]:
        return {"target": self._target}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._target, self._lock = state["target"], threading.Lock()


__all__ = [
    "Actor",
    "ByName",
    "DirectHandle",
    "Fetch",
    "Method",
    "answered",
    "ask",
    "call",
    "kill",
    "tell",
]
