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
- the ``G`` gradients are summed in an order no world size changes
  (:mod:`ftjob.worker.exact_sum`). Where ``G`` is a power of two (so is every world size that
  divides it), in float32 in one fixed binary tree over the micro-batches, neighbours first:
  a rank's run is a subtree it sums itself, and the ranks' subtrees meet in all-reduces of two
  ranks, whose result is ``a + b`` on both. Otherwise each tensor's terms are truncated to a
  power-of-two grid that is a function of its largest magnitude over the ``G`` (a max is
  order-independent) and added as integers in float64 -- exact in any order or grouping. Each
  rank converts its terms as autograd produces them, against the scale the previous step
  agreed, and sends them in buckets while the last backward pass runs; a tensor whose scale
  moved is summed again with the agreed one, which gives the same bits as a step whose guess
  held;
- BatchNorm's running statistics (every buffer of the model) are updated by micro-batch 0
  alone, always rank 0's, and travel to the other ranks as their bit patterns in an integer
  all-reduce (the others add zeros).

Precision kept (:mod:`ftjob.worker.exact_sum`): in the tree, float32's -- each element of the
mean is a float32 sum of its ``G`` terms, rounded ``log2 G`` times, as data parallel mode's. On
the grid, a tensor whose largest micro-batch gradient magnitude is ``M`` is summed on a grid of
at most ``M * 2**(ceil(log2 G) - 45)``: every element within ``2**(22 - ceil(log2 G))`` of ``M``
keeps all 24 bits of its float32 value, smaller ones are truncated to the grid (an error below
one step a term); the sum adds no error of its own; the mean is rounded from float64 to float32.

Cost on the wire, per step and rank: in the tree 4 bytes a gradient element at each of its
``log2 W`` levels (DDP's 4 at two ranks); on the grid 8 (float64) and 40 a parameter tensor
(its counters); either, 8 a buffer element.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftjob.policy.elastic import fixed_micro_batches
from ftjob.worker.exact_sum import TwiceAccumulated, Workspace

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
    if isinstance(exc, TwiceAccumulated):
        return said
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
    micro-batches, their gradients summed with every other rank's in an order no world size
    changes (:class:`ftjob.worker.exact_sum.TreeSum` for a power-of-two count of them, else
    :class:`~ftjob.worker.exact_sum.GradientSum`), and micro-batch 0's buffers on every rank."""

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
        sums = self.work.gradient_sum(params, self.rank, self.world, count * self.world)
        sums.start(count, count * self.world)
        total = torch.zeros((), device=images.device)
        held: list[torch.Tensor] | None = None  # the buffers micro-batch 0 left
        for i in range(count):
            index, rows = first + i, slice(i * self.micro, (i + 1) * self.micro)
            x, y = images[rows], labels[rows]
            if keep is not None:  # skipped files: a loss of 0, as in data parallel mode
                x, y = x[keep[rows]], y[keep[rows]]
            if index > 0 and held is None:
                held = [b.detach().clone() for b in buffers]
            sums.micro(i)
            if x.shape[0]:
                torch.manual_seed(micro_seed(self.seed, step, index))
                loss = loss_of(x, y) * (x.shape[0] / self.micro)
                if i == 0:
                    before_backward()
                loss.backward()  # the gradients go into the sum as they arrive
                total += loss.detach()
                if held:  # only micro-batch 0 moves the running statistics
                    torch._foreach_copy_(buffers, held)
            elif i == 0:
                before_backward()
        sums.finish()
        self.ready()
        if self.world > 1:  # rank 0's buffers as bit patterns; the other ranks add zeros
            device = buffers[0].device if buffers else sums.device
            shared = buffer_bits(buffers, self.rank == 0, device)
            dist.all_reduce(shared, op=dist.ReduceOp.SUM)
            if self.rank > 0:
                set_from_bits(buffers, shared)
        sums.result()
        return total / count


def buffer_bits(buffers: list[torch.Tensor], mine: bool, device: Any) -> torch.Tensor:
    """The buffers' bit patterns as one int64 tensor on ``device`` (the collective's: NCCL
    takes no CPU tensor) (``mine``), or zeros of its size."""
    if not mine or not buffers:
        return torch.zeros(sum(b.numel() for b in buffers), dtype=torch.int64, device=device)
    return torch.cat([_as_bits(b) for b in buffers]).to(device)


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
