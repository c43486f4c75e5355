"""Exact mode's gradient sum: the mean of a global batch's ``G`` micro-batch gradients with
the same bits whichever ranks computed which micro-batches, summed while the last backward
pass runs. Two sums, chosen by ``G`` alone (so every world size of a run takes the same one):

- ``G`` a power of two (so is every world size that divides it): :class:`TreeSum`, float32
  additions in one fixed binary tree over the micro-batches, whose subtrees are the ranks'
  runs and whose upper levels are all-reduces of two ranks -- float32's precision, DDP's bytes
  on the wire at two ranks;
- any other ``G``: :class:`GradientSum`, integers on a power-of-two grid, below.

**The grid.** Each tensor's terms are summed as integers: a micro-batch gradient ``g`` is
multiplied by ``2**shift`` (exact: a power of two) and truncated toward zero, and the integers
are added in float64. Every term is below ``2**(53 - guard)`` in magnitude (``guard =
ceil(log2 G)``), so every partial sum is an integer below ``2**53``: float64 holds it exactly,
and any order or grouping of the additions -- one rank's, any all-reduce's -- gives the same
sum. The mean is that sum times ``1 / (G * 2**shift)``, rounded to float64 and then to float32.

**The scale** of a tensor is a function of its largest micro-batch gradient magnitude ``M``
alone (over all ``G`` terms): with ``M < 2**E``, its *class* ``T`` is ``E`` rounded up to a
multiple of :func:`class_bits` (8 up to ``G = 2**22``), and ``shift = 53 - guard - T``. So
``M < 2**T``, and ``M >= 2**(T - 8)``: the grid step is at most ``M * 2**(guard - 45)``,
every element within ``2**(22 - guard)`` of ``M`` keeps all 24 bits of its float32 value (``M``
itself up to ``G = 2**22``; past it the class narrows so that ``M`` still does), and smaller
ones are truncated to the grid (an error below one step a term).

**Without a round trip.** A tensor's class moves rarely from step to step (it spans 8
octaves), so each rank converts and sums every term as its gradient arrives (a hook after
autograd accumulated it), against the class the previous step agreed, and sends the integers
in buckets as the last micro-batch's backward pass makes them ready. Beside the integers each
tensor carries :data:`FLAGS` counters in the same all-reduce: ranks whose terms were not
finite, ranks whose own class was above the guess, ranks at it, and the sum and the sum of
squares of the ranks' guesses (equal iff ``world * sum_sq == sum**2``). The guess held iff no
rank was above it, one was at it and all guessed the same: then the integers are those the
true class gives. Otherwise (a new run's first step, a class that moved) every rank redoes
that tensor's sum from its kept gradients with the class agreed by an all-reduce of maxima --
the same computation, so the same bits, whichever path a step took.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SUM_BITS = 53  # float64's significand: integer sums below 2**53 are exact in any order
CLASS_BITS = 8  # a tensor's scale moves in steps of 2**8 (fewer where G is huge)
CHUNK = 1 << 19  # elements an op: its scratch stays in cache
BUCKET_ELEMENTS = 2 << 20  # float64 elements an all-reduce (16 MiB), launched as they fill
ZERO = -1000.0  # the class of an all-zero tensor: below every finite one (-144 .. 128)
UNKNOWN = 1000.0  # no guess: above every finite class, so every rank's is below it
FLAGS = 5  # non-finite ranks, ranks above the guess, ranks at it, sum of guesses, of squares


class TwiceAccumulated(RuntimeError):
    """A parameter's gradient was accumulated twice in one backward pass (a reentrant
    activation checkpoint runs a backward of its own): exact mode takes each micro-batch's
    gradient as autograd accumulates it, once, and would sum only a part. Every attempt would
    meet it again: the run's fatal error."""

    def __init__(self, index: int, shape: Any) -> None:
        super().__init__(
            f"trainer.exact=true: parameter {index} (shape {tuple(shape)}) received its gradient "
            "twice in one backward pass -- a reentrant activation checkpoint "
            "(torch.utils.checkpoint with use_reentrant=True) runs a backward of its own; use "
            "use_reentrant=False, or train without trainer.exact"
        )


def guard_bits(total: int) -> int:
    """Bits above a term that the sum of ``total`` terms needs."""
    return math.ceil(math.log2(total)) if total > 1 else 0


def class_bits(total: int) -> int:
    """A class's width: the largest elements keep ``54 - width - guard`` >= 24 bits."""
    width = min(CLASS_BITS, 30 - guard_bits(total))
    if width < 1:
        raise ValueError(f"exact mode sums at most 2**29 micro-batches a step, not {total}")
    return width


def scale_classes(maxima: torch.Tensor, total: int) -> torch.Tensor:
    """Each tensor's class (float64) from its largest magnitude: its exponent ``E``
    (``M < 2**E``) rounded up to a multiple of :func:`class_bits`; :data:`ZERO` for 0, NaN
    where ``M`` is not finite."""
    width = class_bits(total)
    exponent = torch.frexp(maxima.float())[1].to(torch.float64)
    top = torch.ceil(exponent / width) * width
    top = torch.where(maxima == 0, ZERO, top)
    return torch.where(maxima.isfinite(), top, math.nan)


def shift_of(top: float, total: int) -> int:
    """The power of two a class's terms are multiplied by before truncation."""
    return 0 if top == ZERO else SUM_BITS - guard_bits(total) - int(top)


@dataclass(frozen=True)
class Room:
    """A chunk's scratch and a float64 zero, on one device: torch's CPU kernels that mix
    dtypes allocate a temporary for the cast, which past a few MB is fresh memory -- page
    faults -- on every call; a chunk's scratch stays in cache."""

    w32: torch.Tensor
    sum64: torch.Tensor
    term64: torch.Tensor
    zero: torch.Tensor

    @classmethod
    def on(cls, device: Any) -> Room:
        return cls(
            torch.empty(CHUNK, dtype=torch.float32, device=device),
            torch.empty(CHUNK, dtype=torch.float64, device=device),
            torch.empty(CHUNK, dtype=torch.float64, device=device),
            torch.zeros((), dtype=torch.float64, device=device),
        )


def sum_on_grid(
    acc: torch.Tensor, terms: Sequence[torch.Tensor | None], shift: int, room: Room
) -> None:
    """``acc`` (flat float64) = the sum of ``trunc(term * 2**shift)`` over ``terms`` (one
    tensor's gradients of a rank's micro-batches; None: no gradient, zeros), a chunk at a time
    so that only the gradients and the sum go through memory."""
    flats = [t.reshape(-1) for t in terms if t is not None]  # views of contiguous gradients
    if not flats:
        acc.zero_()
        return
    big = shift > 126  # 2**-shift would leave float32's normal range: scaled up in two steps
    divisor = math.ldexp(1.0, -min(shift, 126))
    for start in range(0, acc.numel(), CHUNK):
        a = acc[start : start + CHUNK]
        k = a.numel()
        w, total, term = room.w32[:k], room.sum64[:k], room.term64[:k]
        for i, flat in enumerate(flats):
            g = flat[start : start + k]
            if big:
                g = torch.mul(g, math.ldexp(1.0, shift - 126), out=w)
            torch.div(g, divisor, rounding_mode="trunc", out=w)
            if len(flats) == 1:
                a.copy_(w)
            elif i == 0:
                total.copy_(w)
            elif i < len(flats) - 1:
                total.add_(term.copy_(w))
            else:
                torch.add(total, term.copy_(w), out=a)


def mean_from_grid(
    acc: torch.Tensor, shift: int, total: int, out: torch.Tensor, room: Room
) -> None:
    """``out`` (float32) = ``acc / (total * 2**shift)``: ``acc`` times that reciprocal in
    float64 (exact where ``total`` is a power of two), rounded to float32; ``+ 0`` makes every
    zero +0, whichever signs the terms' zeros had."""
    alpha = math.ldexp(1.0 / total, -shift)
    for a, o in zip(acc.split(CHUNK), out.split(CHUNK), strict=True):
        o.copy_(torch.add(room.zero, a, alpha=alpha, out=room.sum64[: a.numel()]))


class Workspace:
    """Exact mode's buffers, kept from step to step: allocating (and first touching) a few
    hundred MB a step costs more than the arithmetic on them. ``tree``: a power-of-two ``G`` is
    summed in its fixed tree (:class:`TreeSum`); False: on the grid at any ``G``."""

    def __init__(self, tree: bool = True) -> None:
        self.tree = tree
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}
        self._sums: dict[tuple[Any, ...], GradientSum | TreeSum] = {}
        self._rooms: dict[Any, Room] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        key = (name, device)
        found = self._buffers.get(key)
        if found is None or found.shape != shape or found.dtype != dtype:
            found = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return found

    def room(self, device: Any) -> Room:
        found = self._rooms.get(device)
        if found is None:
            found = self._rooms[device] = Room.on(device)
        return found

    def gradient_sum(
        self, params: list[torch.Tensor], rank: int, world: int, total: int
    ) -> GradientSum | TreeSum:
        """The sum of ``total`` micro-batch gradients for these parameters (hooked once; the
        grid's guesses kept from step to step): :class:`TreeSum` where ``total`` is a power of
        two, else :class:`GradientSum` -- a function of ``G`` alone, so every world size of a
        run takes the same one."""
        tree = self.tree and is_tree(total)
        key = (tree, *(id(p) for p in params))
        found = self._sums.get(key)
        if found is None:
            kind = TreeSum if tree else GradientSum
            found = self._sums[key] = kind(params, rank, world, self)
        return found


def buckets_of(lengths: Sequence[int]) -> list[list[int]]:
    """Tensor indices in all-reduce buckets: the last tensors first (backward's order), a
    bucket closed once it holds :data:`BUCKET_ELEMENTS`."""
    buckets: list[list[int]] = [[]]
    size = 0
    for t in reversed(range(len(lengths))):
        if size >= BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += lengths[t]
    return buckets if buckets[0] else []


class HookedSum:
    """What both sums share: each tensor's place in all-reduce buckets of a flat buffer
    (``flags`` float64 counters after each tensor of a bucket, the grid's), the hooks that
    hand each micro-batch's gradients to :meth:`on_grad`, and a step's bookkeeping --
    :meth:`start` a step, :meth:`micro` before each local micro-batch's backward pass,
    :meth:`finish` once this rank's passes are done; a bucket is launched (:meth:`_launch`)
    as soon as its tensors are summed, in bucket order on every rank (gloo pairs calls)."""

    def __init__(self, params: list[torch.Tensor], rank: int, world: int, flags: int = 0):
        self.params, self.rank, self.world = params, rank, world
        self.lengths = [p.numel() for p in params]
        self.buckets = buckets_of(self.lengths)
        self.bucket_of = [0] * len(params)
        self.offset = [0] * len(params)
        self.spans: list[tuple[int, int]] = []  # a bucket's slice of the buffer
        at = 0
        for b, members in enumerate(self.buckets):
            start = at
            for t in members:
                self.bucket_of[t], self.offset[t] = b, at
                at += self.lengths[t]
            at += flags * len(members)
            self.spans.append((start, at))
        self.size = at
        self.device = params[0].device if params else torch.device("cpu")
        self.count = 0  # local micro-batches the views were made for
        self.armed = False
        me = weakref.ref(self)  # the model's hooks must not keep a discarded sum alive
        for t, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, t=t: _fire(me, t, p))

    def start(self, count: int, total: int) -> None:
        if count != self.count:
            self._views(count)
        self.total, self.local = total, 0
        self._begin(count)
        self.done = [False] * len(self.params)
        self.pending = [len(m) for m in self.buckets]
        self.launched: list[Any] = []
        self.next_bucket = 0
        for p in self.params:
            p.grad = None
        self.armed = True

    def micro(self, local: int) -> None:
        """The local micro-batch whose backward pass comes next."""
        self.local = local

    def finish(self) -> None:
        """This rank's backward passes are done: tensors no gradient reached in the last
        micro-batch (unused, or a micro-batch of skipped samples) count as zeros, and every
        bucket is on its way."""
        for t in range(len(self.params)):
            self._done(t)
        self.armed = False

    def _summed(self, t: int) -> None:
        """Tensor ``t``'s local sum is in place: its bucket goes once complete."""
        self.pending[self.bucket_of[t]] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def _views(self, count: int) -> None:
        raise NotImplementedError

    def _begin(self, count: int) -> None:
        raise NotImplementedError

    def _done(self, t: int) -> None:
        raise NotImplementedError

    def _launch(self, b: int) -> None:
        raise NotImplementedError

    def on_grad(self, t: int, p: torch.Tensor) -> None:
        raise NotImplementedError


class GradientSum(HookedSum):
    """One model's exact gradient sum on the grid, step after step (:class:`HookedSum`): its
    hooks convert the gradients as they arrive and launch the buckets during the last
    micro-batch's backward pass; :meth:`result` for the mean in every parameter's ``.grad``."""

    def __init__(self, params: list[torch.Tensor], rank: int, world: int, work: Workspace):
        super().__init__(params, rank, world, FLAGS)
        self.work, device = work, self.device
        self.guess = torch.full((len(params),), UNKNOWN, dtype=torch.float64, device=device)
        self.shifts: list[int | None] = [None] * len(params)  # the guess's, None: no guess
        self.members = [torch.tensor(m, dtype=torch.long, device=device) for m in self.buckets]
        self.redone: tuple[int, ...] = ()  # the tensors the last step summed again

    def _begin(self, count: int) -> None:
        self.extremes.zero_()
        self.stash: list[list[torch.Tensor | None]] = [
            [None] * len(self.params) for _ in range(count)
        ]

    def _views(self, count: int) -> None:
        """The step's buffers for ``count`` local micro-batches, and each tensor's views of
        them (made once: a view costs the hooks more than the arithmetic on a small tensor)."""
        n, shapes = len(self.params), [p.shape for p in self.params]
        self.count = count
        self.acc = torch.empty(self.size, dtype=torch.float64, device=self.device)
        kept = torch.empty((count - 1, self.size), dtype=torch.float32, device=self.device)
        mean = torch.empty(sum(self.lengths), dtype=torch.float32, device=self.device)
        self.room = self.work.room(self.device)
        self.sums = [self.acc[lo : lo + k] for lo, k in zip(self.offset, self.lengths, strict=True)]
        self.kept = [
            [
                row[lo : lo + k].view(shape)
                for lo, k, shape in zip(self.offset, self.lengths, shapes, strict=True)
            ]
            for row in kept
        ]
        self.means = list(mean.split(self.lengths))
        self.grads = [m.view(shape) for m, shape in zip(self.means, shapes, strict=True)]
        self.extremes = torch.zeros((2, count, n), dtype=torch.float32, device=self.device)
        self.lows, self.highs = self.extremes[0], self.extremes[1]
        self.extreme_views = [
            [(self.lows[j, t], self.highs[j, t]) for t in range(n)] for j in range(count)
        ]

    def on_grad(self, t: int, p: torch.Tensor) -> None:
        """Tensor ``t``'s gradient of this micro-batch, just accumulated: kept (for the last
        micro-batch's sum, and for a sum redone) and its largest magnitude noted; after the
        last micro-batch, every term converted against the guess and summed."""
        g, p.grad = p.grad, None
        if g is None:
            return
        if self.stash[self.local][t] is not None:
            raise TwiceAccumulated(t, p.shape)
        last = self.local == self.count - 1
        # An earlier micro-batch's copied, so that autograd's memory goes back to the
        # allocator for the next backward pass (fresh memory faults in page by page).
        kept = g if last else self.kept[self.local][t].copy_(g)
        self.stash[self.local][t] = kept
        if self.lengths[t]:
            torch.aminmax(kept, out=self.extreme_views[self.local][t])
        if last:
            self._done(t)

    def maxima(self, members: torch.Tensor) -> torch.Tensor:
        """These tensors' largest magnitudes over this rank's micro-batches (NaN: one held a
        NaN)."""
        high = self.highs[:, members].amax(dim=0)
        return torch.maximum(high, self.lows[:, members].amin(dim=0).neg())

    def _done(self, t: int) -> None:
        if self.done[t]:
            return
        self.done[t] = True
        shift = self.shifts[t]
        if shift is not None:
            terms = [self.stash[local][t] for local in range(self.count)]
            sum_on_grid(self.sums[t], terms, shift, self.room)
        self._summed(t)

    def _launch(self, b: int) -> None:
        members, (_, stop) = self.members[b], self.spans[b]
        top = scale_classes(self.maxima(members), self.total)
        guess = self.guess[members]
        flags = self.acc[stop - FLAGS * len(members) : stop].view(len(members), FLAGS)
        flags[:, 0] = top.isnan()
        flags[:, 1] = top > guess
        flags[:, 2] = top == guess
        flags[:, 3] = guess
        flags[:, 4] = guess * guess
        if self.world > 1:
            span = self.acc[self.spans[b][0] : stop]
            self.launched.append(dist.all_reduce(span, op=dist.ReduceOp.SUM, async_op=True))

    def result(self) -> None:
        """Every parameter's ``.grad``: the mean, each tensor from the sum its guess gave
        where the guess held (converted bucket by bucket as they arrive), else from the sum
        redone with the agreed class; NaN where a term was not finite. Ends the step (the
        kept gradients are let go)."""
        views = self.means
        redo: list[int] = []
        for b in range(len(self.buckets)):
            if self.world > 1:
                self.launched[b].wait()
            redo += self._settle(b, views)
        if redo:
            self._redo(redo, views)
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad
        self.redone = tuple(redo)
        self.stash = []

    def _settle(self, b: int, views: Sequence[torch.Tensor]) -> list[int]:
        """Bucket ``b``'s means where its guesses held, NaN where a term was not finite;
        returns the tensors to sum again."""
        members, (_, stop) = self.buckets[b], self.spans[b]
        flags = self.acc[stop - FLAGS * len(members) : stop].view(-1, FLAGS).tolist()
        redo = []
        for t, (nonfinite, above, at, guesses, squares) in zip(members, flags, strict=True):
            shift = self.shifts[t]
            if nonfinite:
                views[t].fill_(math.nan)
                self.guess[t], self.shifts[t] = UNKNOWN, None
            elif shift is None or above or not at or self.world * squares != guesses**2:
                redo.append(t)
            else:
                mean_from_grid(self.sums[t], shift, self.total, views[t], self.room)
        return redo

    def _redo(self, redo: list[int], views: Sequence[torch.Tensor]) -> None:
        """The tensors whose guess did not hold, summed again from the kept gradients with
        the class of their largest magnitude over all ranks (one all-reduce of maxima, one of
        the sums)."""
        index = torch.tensor(redo, dtype=torch.long, device=self.device)
        maxima = self.maxima(index)
        if self.world > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        tops = scale_classes(maxima, self.total)
        self.guess[index] = tops
        lengths = [self.lengths[t] for t in redo]
        sums = self.work.get("redo", (sum(lengths),), torch.float64, self.device)
        shifts = [shift_of(top, self.total) for top in tops.tolist()]
        for t, acc, shift in zip(redo, sums.split(lengths), shifts, strict=True):
            terms = [self.stash[local][t] for local in range(self.count)]
            sum_on_grid(acc, terms, shift, self.room)
            self.shifts[t] = shift
        if self.world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        for t, acc, shift in zip(redo, sums.split(lengths), shifts, strict=True):
            mean_from_grid(acc, shift, self.total, views[t], self.room)


def is_tree(total: int) -> bool:
    """Is ``G`` a power of two: summed in its tree (:class:`TreeSum`)?"""
    return total >= 1 and total & (total - 1) == 0


def tree_sum(terms: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = the sum of ``terms`` (a power-of-two count) in the tree of neighbours,
    ``((t0 + t1) + (t2 + t3)) + ...``; the terms are overwritten."""
    while len(terms) > 2:
        terms = [a.add_(b) for a, b in zip(terms[0::2], terms[1::2], strict=True)]
    if len(terms) == 2:
        torch.add(terms[0], terms[1], out=out)
    else:
        out.copy_(terms[0])


def pair_groups(rank: int, world: int) -> list[Any]:
    """This rank's process group of two at each level of the tree over ranks (level ``s``:
    ``rank`` and ``rank ^ 2**s``); None: the whole world (two ranks). Every rank creates every
    group, in one order (``new_group`` is collective)."""
    if world <= 2:
        return [None] * (world - 1)
    mine = []
    for level in range(world.bit_length() - 1):
        for low in range(world):
            high = low ^ (1 << level)
            if low < high:
                group = dist.new_group([low, high])
                if rank in (low, high):
                    mine.append(group)
    return mine


class TreeSum(HookedSum):
    """Exact mode's sum where ``G`` is a power of two (so is every world size that divides it):
    the ``G`` micro-batch gradients added in float32 in one fixed binary tree, neighbours first
    -- ``((g0 + g1) + (g2 + g3)) + ...``. A rank's run of ``G / W`` micro-batches is a subtree,
    which it sums itself as the last micro-batch's gradients arrive; the ranks' subtrees meet in
    ``log2 W`` levels, each an all-reduce of two ranks (level ``s``: ranks ``r`` and ``r ^
    2**s``), whose result is ``a + b`` on both (IEEE addition commutes; a sum of two has no
    order). So every element of the mean is the same float32 additions in the same tree at
    every world size, and the same bits. Precision: float32's, as data parallel mode's (each
    element rounded ``log2 G`` times; nothing truncated); on the wire 4 bytes an element a level
    (DDP's at two ranks). The mean is the sum times ``1 / G``, exact for a power of two.

    The interface of :class:`GradientSum`; the first bucket's first level is sent while the last
    backward pass runs, the other levels after it."""

    redone: tuple[int, ...] = ()  # the grid's: a tree sum has nothing to redo

    def __init__(self, params: list[torch.Tensor], rank: int, world: int, work: Workspace):
        super().__init__(params, rank, world)
        self.groups = pair_groups(rank, world)

    def _begin(self, count: int) -> None:
        self.have = [[False] * len(self.params) for _ in range(count)]

    def _views(self, count: int) -> None:
        """The step's buffers for ``count`` local micro-batches: the sum (the parameters'
        ``.grad`` views it), and the earlier micro-batches' gradients kept for it."""
        shapes = [p.shape for p in self.params]
        self.count = count
        self.flat = torch.empty(self.size, dtype=torch.float32, device=self.device)
        kept = torch.empty((count - 1, self.size), dtype=torch.float32, device=self.device)
        spans = list(zip(self.offset, self.lengths, shapes, strict=True))
        self.sums = [self.flat[lo : lo + k] for lo, k, _ in spans]
        self.grads = [self.flat[lo : lo + k].view(shape) for lo, k, shape in spans]
        self.kept = [[row[lo : lo + k] for lo, k, _ in spans] for row in kept]

    def on_grad(self, t: int, p: torch.Tensor) -> None:
        """Tensor ``t``'s gradient of this micro-batch: an earlier micro-batch's kept, the
        last one's summed with them into the tensor's part of the sum."""
        g, p.grad = p.grad, None
        if g is None:
            return
        if self.have[self.local][t] or (self.local == self.count - 1 and self.done[t]):
            raise TwiceAccumulated(t, p.shape)
        if self.local < self.count - 1:
            self.kept[self.local][t].copy_(g.reshape(-1))
            self.have[self.local][t] = True
            return
        self._done(t, g.reshape(-1))

    def _done(self, t: int, last: torch.Tensor | None = None) -> None:
        """Tensor ``t``'s local subtree summed (a micro-batch without its gradient adds
        zeros: the same additions at every world size); its bucket sent once complete."""
        if self.done[t]:
            return
        self.done[t] = True
        terms = []
        for local in range(self.count - 1):
            kept = self.kept[local][t]
            terms.append(kept if self.have[local][t] else kept.zero_())
        terms.append(last if last is not None else torch.zeros_like(self.sums[t]))
        tree_sum(terms, self.sums[t])
        self._summed(t)

    def _launch(self, b: int) -> None:
        if self.groups:
            lo, hi = self.spans[b]
            work = dist.all_reduce(self.flat[lo:hi], group=self.groups[0], async_op=True)
            self.launched.append(work)

    def result(self) -> None:
        """Every parameter's ``.grad``: the tree's sum over all ranks (the levels above the
        first, bucket by bucket), times ``1 / G``."""
        for b, (lo, hi) in enumerate(self.spans):
            span = self.flat[lo:hi]
            if self.groups:
                self.launched[b].wait()
                for group in self.groups[1:]:
                    dist.all_reduce(span, group=group)
            span.mul_(1.0 / self.total)
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad


def _fire(sum_of: weakref.ref[Any], t: int, p: torch.Tensor) -> None:
    found = sum_of()
    if found is not None and found.armed:
        found.on_grad(t, p)
