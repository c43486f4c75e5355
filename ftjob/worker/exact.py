"""Exact mode (``trainer.exact=true``): the same weights, bit for bit, at any world size.

Data parallel training sums a global batch's gradient in an order that depends on the world
size (each rank's micro-batches, then the all-reduce's tree), lets BatchNorm's running
statistics follow rank 0's share of the batch, and seeds step-local randomness per rank. Here
every one of those is a function of the global batch alone:

- the global batch is cut into ``G`` micro-batches of ``trainer.micro_batch_size`` samples,
  numbered in the data order; rank ``r`` of ``W`` computes the contiguous run
  ``r*G/W .. (r+1)*G/W - 1`` (its slice of the global batch is exactly that run), each on its
  own, with the same shapes and kernels wherever it lands;
- dropout and any other step-local draw is seeded by ``(seed, step, micro-batch index)``;
- the ``G`` gradients are summed exactly (:func:`exact_sum`): each tensor against a
  power-of-two scale agreed by an all-reduce of its largest magnitude (a max is
  order-independent), as 64-bit integers -- whose sums are associative, so any grouping of
  micro-batches onto ranks gives the same bits -- all-reduced as integers, then back to float;
- BatchNorm's running statistics (every buffer of the model) are updated by micro-batch 0
  alone, always rank 0's, and travel to the other ranks as their bit patterns in the same
  integer all-reduce (the others add zeros).

Precision kept: a tensor whose largest micro-batch gradient magnitude is below ``2**e`` is
summed on the grid ``2**(e + ceil(log2 G) - 62)``. Every element of magnitude at least
``2**(e + ceil(log2 G) - 39)`` (within about ``2**38 / G`` of that largest one) keeps all 24
bits of its float32 value; smaller ones are rounded to the grid (absolute error at most half a
step per micro-batch), below half a step to 0. The sum itself adds no error; it is rounded
once, through float64, to float32.

Cost on the wire, per step and rank: 8 bytes a gradient element (int64, where DDP sends
float32's 4), 8 a buffer element, 4 a parameter tensor (the maxima).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftjob.policy.elastic import fixed_micro_batches

HEADROOM_BITS = 62  # the integer sum of G terms stays below 2**62 < 2**63
MICRO_STREAM = 0xE8AC7  # keeps micro-batch seeds apart from the per-rank step seeds
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def micro_seed(seed: int, step: int, index: int) -> int:
    """Seed of micro-batch ``index`` of ``step`` (dropout...): the same on any rank, at any
    world size, in any attempt."""
    return int(np.random.SeedSequence([seed, step, index, MICRO_STREAM]).generate_state(1)[0])


def pin_kernels(trainer: Any, device: torch.device) -> None:
    """Intra-op threads fixed to ``trainer.resources_per_worker.CPU`` (in every mode); in
    exact mode on a GPU, deterministic kernels only (:func:`deterministic_kernels`)."""
    torch.set_num_threads(max(1, int(trainer.worker_cpus)))
    if trainer.exact and device.type == "cuda":
        deterministic_kernels()


# The two cuBLAS workspace configurations under which cuBLAS gives the same bits run to run
# (NVIDIA's cuBLAS docs, "Results reproducibility"; torch checks for exactly these).
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
NO_DETERMINISTIC_KERNEL = (
    "does not have a deterministic implementation",  # torch's alert for an op
    "Deterministic behavior was enabled",  # cuBLAS without a deterministic workspace
)


def deterministic_kernels() -> None:
    """What a CUDA process needs for the same bits from the same inputs, set before its
    first cuBLAS call: cuBLAS with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, kept where
    already one of the deterministic two), cuDNN's deterministic algorithms and no
    benchmarking (which may pick another algorithm per process), and torch's deterministic
    implementations -- an op that has none raises (:func:`refused_op`) rather than warn, for
    a run that trained through it would not be bit-identical. TF32 is left as it is: it
    rounds the inputs of float32 convolutions and matrix products, the same way every time."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def refused_op(exc: BaseException) -> str | None:
    """Exact mode's fatal error for ``exc`` when it is torch refusing an op that has no
    deterministic kernel (every attempt would meet it again), else None."""
    said = str(exc)
    if not isinstance(exc, RuntimeError) or not any(m in said for m in NO_DETERMINISTIC_KERNEL):
        return None
    if NO_DETERMINISTIC_KERNEL[1] in said:  # cuBLAS: the workspace setting, not an op
        return (
            "trainer.exact=true on a GPU needs cuBLAS's deterministic workspace, and cuBLAS "
            "started in the worker before CUBLAS_WORKSPACE_CONFIG was one (now "
            f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}): set it to ':4096:8' where the "
            "workers start, e.g. ray.runtime_env={env_vars: {CUBLAS_WORKSPACE_CONFIG: ':4096:8'}}"
        )
    op = said.splitlines()[0].split(", but you set")[0][:200]
    return (
        "trainer.exact=true on a GPU runs deterministic kernels only, and the model uses an "
        f"op that has none: {op} -- leave that op out of the model, or train without "
        "trainer.exact (the weights then depend on the world size)"
    )


@dataclass(frozen=True)
class ExactBackward:
    """Exact mode's step (a :class:`ftjob.worker.backward.Backward`): this rank's run of fixed
    micro-batches, their gradients summed exactly with every other rank's, and micro-batch 0's
    buffers on every rank."""

    rank: int
    world: int
    micro: int  # samples per micro-batch (trainer.micro_batch_size)
    seed: int
    ready: Callable[[], None] = lambda: None  # this rank's gradients are computed
    work: Workspace = field(default_factory=lambda: Workspace())  # reused from step to step

    def __call__(
        self,
        step: int,
        model: Any,
        batch: Any,
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        before_backward: Callable[[], None],
    ) -> torch.Tensor:
        images, labels, keep = batch.images, batch.labels, batch.keep()
        count = fixed_micro_batches(images.shape[0], self.micro)
        first = self.rank * count
        params = [p for p in model.parameters() if p.requires_grad]
        buffers = list(model.buffers())
        lengths = [p.numel() for p in params]
        grads, maxima = self.work.rows(count, lengths, images.device)
        total = torch.zeros((), device=images.device)
        held: list[torch.Tensor] | None = None  # the buffers micro-batch 0 left
        for i in range(count):
            index, rows = first + i, slice(i * self.micro, (i + 1) * self.micro)
            x, y = images[rows], labels[rows]
            if keep is not None:  # skipped files: a loss of 0, as in data parallel mode
                x, y = x[keep[rows]], y[keep[rows]]
            for p in params:
                p.grad = None
            if index > 0 and held is None:
                held = [b.detach().clone() for b in buffers]
            if x.shape[0]:
                torch.manual_seed(micro_seed(self.seed, step, index))
                loss = loss_of(x, y) * (x.shape[0] / self.micro)
                if i == 0:
                    before_backward()
                loss.backward()
                total += loss.detach()
                if held is not None:  # only micro-batch 0 moves the running statistics
                    torch._foreach_copy_(buffers, held)
            elif i == 0:
                before_backward()
            flat = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch.cat([g.reshape(-1) for g in flat], out=grads[i])
            largest_magnitudes(grads[i].split(lengths), out=maxima[i])
        self.ready()
        # Rank 0's buffers ride in the gradients' integer all-reduce as their bit patterns;
        # the other ranks add zeros.
        shared = buffer_bits(buffers, self.rank == 0) if self.world > 1 else None
        args = (grads, maxima, lengths, count * self.world, self.world, shared, self.work)
        summed, shared = exact_sum(*args)
        for p, g in zip(params, summed.split(lengths), strict=True):
            p.grad = g.view_as(p)
        if shared is not None and self.rank > 0:
            set_from_bits(buffers, shared)
        return total / count


class Workspace:
    """Exact mode's buffers, kept from step to step: allocating (and first touching) a few
    hundred MB a step costs more than the arithmetic on them."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        key = (name, device)
        found = self._buffers.get(key)
        if found is None or found.shape != shape or found.dtype != dtype:
            found = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return found

    def rows(
        self, count: int, lengths: list[int], device: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat gradient row per micro-batch, and each row's largest magnitude per tensor."""
        grads = self.get("grads", (count, sum(lengths)), torch.float32, device)
        return grads, self.get("maxima", (count, len(lengths)), torch.float32, device)


def largest_magnitudes(
    tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], out: torch.Tensor
) -> None:
    """Each tensor's largest magnitude (NaN where it holds a NaN) into ``out``: from its
    minimum and maximum in one pass (on CPU a twentieth of ``_foreach_norm(.., inf)``'s time)."""
    for t, o in zip(tensors, out, strict=True):
        if t.numel() == 0:
            o.fill_(0.0)
            continue
        low, high = torch.aminmax(t)
        torch.maximum(high, low.neg(), out=o)


def exact_sum(
    grads: torch.Tensor,
    maxima: torch.Tensor,
    lengths: list[int],
    total: int,
    world: int,
    rider: torch.Tensor | None = None,
    work: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean of ``total`` micro-batch gradients of which ``grads`` are this rank's (one
    flat float32 row each, the tensors of ``lengths`` side by side; ``maxima``: each row's
    largest magnitude per tensor): the same bits whichever rank holds which rows. A tensor
    with a non-finite element anywhere is NaN. ``rider`` (int64) is summed over the ranks in
    the same all-reduce, and returned summed. ``grads`` is used up (the mean is its first
    row)."""
    work = work or Workspace()
    peak = maxima.amax(dim=0)
    peak = torch.where(peak.isnan(), math.inf, peak)  # NaN and inf: one flag
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    guard = math.ceil(math.log2(total)) if total > 1 else 0
    peaks, exponents = peak.tolist(), torch.frexp(peak)[1].tolist()  # peak < 2**exponent
    usable = [math.isfinite(m) and m > 0 for m in peaks]
    shifts = [
        HEADROOM_BITS - e - guard if ok else 0 for e, ok in zip(exponents, usable, strict=True)
    ]
    # Scaled in float32, in place: a power of two scales exactly (float32 reaches 2**127, so
    # a larger shift -- a tensor below 2**-65 -- takes two steps); the products below 2**-126
    # that lose bits round to 0 anyway. Rounded in place: exact, then exact as int64.
    first = [math.ldexp(1.0, min(s, 127)) for s in shifts]
    rest = [math.ldexp(1.0, max(s - 127, 0)) for s in shifts]
    for row in grads:
        views = list(row.split(lengths))
        torch._foreach_mul_(views, first)
        if any(r != 1.0 for r in rest):
            torch._foreach_mul_(views, rest)
    grads.round_()
    width, riding = grads.shape[1], 0 if rider is None else rider.numel()
    acc = work.get("acc", (width + riding,), torch.int64, grads.device)
    summed = acc[:width]
    summed.copy_(grads[0])
    if grads.shape[0] > 1:
        term = work.get("term", (width,), torch.int64, grads.device)
        for row in grads[1:]:
            summed.add_(term.copy_(row))
    if rider is not None:
        acc[width:] = rider
    if world > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    # Back through float64: the integer to 53 bits, divided by total * 2**shift (exact in
    # float64) -- the same bits as scaling back by 2**-shift (exact) and dividing by total, for
    # IEEE division rounds the same quotient once -- then to float32.
    wide = work.get("wide", (width,), torch.float64, grads.device).copy_(summed)
    denominators = [math.ldexp(float(total), s) for s in shifts]
    torch._foreach_div_(list(wide.split(lengths)), denominators)
    mean = grads[0].copy_(wide)
    for part, ok, m in zip(mean.split(lengths), usable, peaks, strict=True):
        if not ok and m != 0:
            part.fill_(math.nan)
    return mean, (None if rider is None else acc[width:])


def buffer_bits(buffers: list[torch.Tensor], mine: bool) -> torch.Tensor:
    """The buffers' bit patterns as one int64 tensor (``mine``), or zeros of its size."""
    if not mine:
        return torch.zeros(sum(b.numel() for b in buffers), dtype=torch.int64)
    if not buffers:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([_as_bits(b) for b in buffers])


def set_from_bits(buffers: list[torch.Tensor], bits: torch.Tensor) -> None:
    """The buffers set, bit for bit, from :func:`buffer_bits`' pattern."""
    for b, part in zip(buffers, bits.split([b.numel() for b in buffers]), strict=True):
        b.copy_(_from_bits(part, b))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if t.dtype in _BITS:
        flat = flat.view(_BITS[t.dtype])
    return flat.long()


def _from_bits(bits: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype in _BITS:
        return bits.to(_BITS[like.dtype]).view(like.dtype).view_as(like)
    return bits.to(like.dtype).view_as(like)
