"""A training step's gradients: how a rank's slice of the global batch becomes the gradient
the optimizer steps on. Two ways, one interface (:class:`Backward`):

- data parallel (the default): micro-batches of at most ``trainer.micro_batch_size``
  accumulated in place, DDP averaging the ranks' gradients (:func:`backward_in_micro_batches`);
- exact (``trainer.exact=true``): fixed micro-batches whose gradients are summed in an order
  that no world size changes (:class:`ftjob.worker.exact.ExactBackward`).

:func:`data_parallel` builds the model and its step for the mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ftjob.policy.elastic import micro_batches
from ftjob.worker.exact import ExactBackward

if TYPE_CHECKING:  # the step itself needs torch alone (benchmarks/gpu_exact.py runs it so)
    from ftjob.data.streams import Batch

LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Backward(Protocol):
    """Gradients of ``batch`` (this rank's slice of the global batch of ``step``) left in the
    parameters' ``.grad``, the same on every rank; returns the slice's mean loss.
    ``before_backward`` runs once, between the first forward pass and its backward pass."""

    def __call__(
        self,
        step: int,
        model: Any,
        batch: Batch,
        loss_of: LossOf,
        before_backward: Callable[[], None],
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class MicroBatchBackward:
    """Data parallel: :func:`backward_in_micro_batches` with micro-batches of ``batch_size``."""

    batch_size: int

    def __call__(
        self,
        step: int,
        model: Any,
        batch: Batch,
        loss_of: LossOf,
        before_backward: Callable[[], None],
    ) -> torch.Tensor:
        images, labels, keep = batch.images, batch.labels, batch.keep()
        return backward_in_micro_batches(
            model, images, labels, self.batch_size, loss_of, before_backward, keep
        )


def data_parallel(
    model: torch.nn.Module,
    trainer: Any,
    ctx: Any,
    ready: Callable[[], None],
) -> tuple[Any, Backward]:
    """The model as the step sees it, and the step's backward: DDP's (the context's
    ``prepare_model``) by default; with ``trainer.exact`` the bare model on the device -- the
    exact sum replaces DDP's all-reduce and its broadcast of buffers -- and ``ready`` stamped
    when this rank's gradients are ready, before it waits for the others."""
    micro = trainer.micro_batch
    if not trainer.exact:
        return ctx.prepare_model(model), MicroBatchBackward(micro)
    exact = ExactBackward(ctx.rank, ctx.world, micro, trainer.seed, ready)
    return model.to(ctx.device), exact


def backward_in_micro_batches(
    model: Any,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    before_backward: Callable[[], None] = lambda: None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradients of the mean loss over this rank's slice, in micro-batches of at most
    ``batch_size`` (several only below full size: elastic). Each micro-batch's mean loss is
    weighted by its share of the slice, so the accumulated gradient is the slice's mean; a DDP
    model all-reduces once, with the last micro-batch. Returns the slice's mean loss.

    ``keep`` (bool per row) leaves out skipped samples (bad files): they never reach the
    model, and count as a loss of 0 in the slice's mean -- the step's gradient is the kept
    samples' loss summed over the global batch size, at any world size, with no collective
    to count them. A rank whose whole slice was skipped still joins the gradient all-reduce
    (:func:`_blank_backward`)."""
    n = images.shape[0]
    if keep is not None:
        if not bool(keep.any()):
            return _blank_backward(model, images[:1], labels[:1], loss_of, before_backward)
        images, labels = images[keep], labels[keep]
    kept = images.shape[0]
    chunks = micro_batches(kept, batch_size)
    total = torch.zeros((), device=images.device)
    for lo, hi in chunks:
        local = hi < kept and hasattr(model, "no_sync")  # no all-reduce until the last
        with model.no_sync() if local else contextlib.nullcontext():
            loss = loss_of(images[lo:hi], labels[lo:hi])
            if len(chunks) > 1 or kept < n:
                loss = loss * ((hi - lo) / n)
            if lo == 0:  # after DDP's forward sync of buffers, before the gradient all-reduce
                before_backward()
            loss.backward()
        total += loss.detach()
    return total


def _blank_backward(
    model: Any,
    image: torch.Tensor,
    label: torch.Tensor,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    before_backward: Callable[[], None],
) -> torch.Tensor:
    """A zero gradient that still takes part in DDP's all-reduce, for a rank with nothing to
    train this step: one blank image, in eval mode (batch-norm statistics stay as they were),
    its loss weighted 0."""
    was_training = model.training
    model.eval()
    try:
        loss = loss_of(image, label) * 0.0
        before_backward()
        loss.backward()
    finally:
        model.train(was_training)
    return loss.detach()
