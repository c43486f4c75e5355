"""The memory tier's fence: a run's holders take snapshots from the driver that holds the run's
lease (:mod:`ftjob.storage.lease`) and from no deposed one.

Holders outlive the driver (:mod:`ftjob.memory.cluster`), and so, for a while, can the
dead driver's workers: a worker that is still training once the next driver has restored would
put snapshots into the state the live run restores from. So every write to a holder carries the
lease generation of the driver whose worker makes it, and a holder keeps the newest generation
it was told of:

- **The takeover.** A driver that takes the run fences each holder it finds with its
  generation before its workers start (:meth:`GenerationFence.take_over`, ``admit``). What the
  holder then holds of an older, known generation was committed before the takeover and stays
  restorable -- the state the dead driver's workers left, which the next driver restores from.
  What it holds of no known generation (a write without one, a ring slot of an older ftjob) is
  never offered again: fail safe, the durable checkpoint is read instead.
- **Writes of an older generation are refused** (:meth:`GenerationFence.refuses`) and counted,
  the writer told why (:class:`Refused`; a ring writer by the ring's own head). A write of a
  newer generation than the holder knows moves the fence on (a holder the driver did not reach:
  one a rank created on a node that joined later) without admitting anything older.
- **Reads offer only what the fence admits** (:meth:`GenerationFence.admits`): an entry of the
  live generation, or one admitted at the takeover. A restore's reads carry its reader's
  generation: a newer one moves the fence on first, as a write does; an older one is refused
  (not counted: reads are not writes). A write that slipped in between a writer's check and
  the holder's fence (the ring's writers check the head themselves) carries its older
  generation and is never offered, and the live writer's next commit empties its slot.

A holder never told a generation (a run without a lease) takes and offers everything, as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    """A holder's answer to a write it refused: why (the generations, and that another driver
    took the run)."""

    reason: str


class GenerationFence:
    """One holder's fence: ``generation``, the lease generation of the run's live driver as the
    holder was told (None: never told), the entries admitted at the last takeover (keys the
    holder chooses), and the writes refused."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self.admitted: frozenset[Hashable] = frozenset()
        self.refused = 0

    def refuses(
        self, generation: int | None, what: str, by: str = "a worker", count: bool = True
    ) -> Refused | None:
        """The refusal of ``what`` by ``by`` of lease ``generation`` (None: none known),
        counted where ``count`` (a write); None where the holder takes it."""
        if self.generation is None or (generation is not None and generation >= self.generation):
            return None
        self.refused += count
        writer = "no lease generation" if generation is None else f"lease generation {generation}"
        return Refused(
            f"the snapshot holder refused {what} from {by} of {writer}: it is fenced by "
            f"lease generation {self.generation} (another driver took the run)"
        )

    def newer(self, generation: int | None) -> bool:
        """Is ``generation`` newer than the one the holder knows?"""
        return generation is not None and (self.generation is None or generation > self.generation)

    def admits(self, generation: int | None, key: Hashable) -> bool:
        """May the entry ``key`` of a writer of ``generation`` be offered to a restore?"""
        if self.generation is None:
            return True
        return generation == self.generation or key in self.admitted

    def take_over(
        self, generation: int, held: Iterable[tuple[int | None, Hashable]], admit: bool
    ) -> None:
        """Lease ``generation`` holds the run from now on. ``held``: (generation, key) of every
        entry the holder has. With ``admit`` (the driver's own fence, before its workers start)
        those the fence admitted so far and of a known generation stay restorable; without (a
        writer of a newer generation reached the holder first), none of the older ones do."""
        keep = {key for g, key in held if admit and g is not None and self.admits(g, key)}
        self.generation, self.admitted = generation, frozenset(keep)


__all__ = ["GenerationFence", "Refused"]
