"""Validation: every rank's shard of the validation set, evaluated and all-reduced, recorded
once per step. A preemption notice may cut it short; the step is then marked owed, and the
restored attempt runs it before training on (so a notice never loses a validation result, and
a result is never recorded twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftjob import metrics as M
from ftjob.record import ValidationResult


class Validator:
    """``stop`` (a preemption notice, polled between batches) cuts a validation short;
    ``section`` is the heartbeat's section context for the time it runs."""

    def __init__(
        self,
        batches: Any,  # this rank's ValidationSet
        ctx: Any,  # the WorkerContext: device, world, the run recorder
        autocast: bool,
        metrics: M.MetricSet,
        section: Callable[[str], Any],
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.batches, self.device, self.world = batches, ctx.device, ctx.world
        self.record, self.autocast, self.metrics = ctx.recorder, autocast, metrics
        self.section, self.stop = section, stop
        self.validated_step = -1  # the step whose validation ran to its end
        self.cut: int | None = None  # the step whose validation a notice cut short

    def restored(self, step: int, validated: bool) -> None:
        """A checkpoint of ``step`` was restored; ``validated``: its validation had run."""
        self.validated_step = step if validated else -1

    def done(self, step: int) -> bool:
        return self.validated_step == step

    @staticmethod
    def owed(step: int, position: int, validated: bool, every: int) -> bool:
        """Was a restored step due a validation that did not run to its end?"""
        due = step > 0 and (position == 0 or bool(every and step % every == 0))
        return due and not validated

    def run(self, module: torch.nn.Module, step: int, epoch: int) -> None:
        """Validate ``step`` (once), record the result on rank 0."""
        if self.validated_step == step:
            return
        self.validated_step = step
        with self.metrics.timer(M.VALIDATION_STEP), self.section("validation"):
            loss, correct, count, complete = evaluate(
                module, self.batches, self.device, self.autocast, self.world, self.stop
            )
        if not complete:  # a preemption notice: this step's validation runs after the restore
            self.validated_step, self.cut = -1, step
            return
        result = ValidationResult(
            epoch=epoch,
            loss=float(loss / max(count, 1)),
            accuracy=float(correct / max(count, 1)),
            samples=int(count),
            time=time.time(),
        )
        self.metrics.set(M.VALIDATION_LOSS, result.loss)
        self.metrics.set(M.VALIDATION_ACCURACY, result.accuracy)
        self.record.validation(step, result)


@torch.inference_mode()
def evaluate(
    module: torch.nn.Module,
    batches: Any,
    device: torch.device,
    autocast: bool,
    world: int,
    stop: Callable[[], bool] | None = None,
) -> tuple[float, float, float, bool]:
    """(summed loss, correct, count, complete) over every rank's validation shard. ``stop``
    (a preemption notice) cuts it short; every rank still meets in the final all-reduce, and
    the result counts only if no rank stopped."""
    module.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    for batch in batches:
        if stop is not None and stop():
            totals[3] = 1
            break
        images, labels = batch.images, batch.labels
        keep = batch.keep() if hasattr(batch, "keep") else None
        if keep is not None:  # bad files skipped (dataset.bad_files=skip): not evaluated
            images, labels = images[keep], labels[keep]
            if not len(labels):
                continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = module(images)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(1) == labels).sum()
        totals[2] += len(labels)
    if world > 1:
        dist.all_reduce(totals)
    module.train()
    loss, correct, count, stopped = totals.tolist()
    return loss, correct, count, not stopped
