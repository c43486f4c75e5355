"""A training step over micro-batches with samples skipped: the kept samples' loss over the whole
slice, and nothing from a slice with none kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftjob.worker.backward import backward_in_micro_batches


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def test_a_step_trains_on_the_kept_samples_over_the_whole_slice_and_a_skipped_slice_adds_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(144, 2),
    )
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 1, 0])
    keep = torch.tensor([True, False, True, True])

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    # The kept rows alone, their summed loss over the slice of 4: a skipped sample adds 0.
    model.zero_grad()
    (F.cross_entropy(model(images[keep]), labels[keep], reduction="sum") / 4).backward()
    expected = grads(model)
    model.zero_grad()
    loss = backward_in_micro_batches(model, images, labels, 4, loss_of, keep=keep)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(grads(model), expected, strict=True))
    assert loss.item() == pytest.approx(
        F.cross_entropy(model(images[keep]), labels[keep], reduction="sum").item() / 4, rel=1e-5
    )
    # A slice with nothing kept: a zero gradient, batch-norm statistics untouched, still
    # training mode afterwards.
    bn = model[1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    model.zero_grad()
    loss = backward_in_micro_batches(
        model, images, labels, 4, loss_of, keep=torch.zeros(4, dtype=torch.bool)
    )
    assert loss.item() == 0.0 and all(not g.any() for g in grads(model))
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2] and model.training
