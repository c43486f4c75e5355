"""The GPU memory a worker's tensors hold, epoch by epoch: whether a run's memory stays flat.

torch's caching allocator counts the bytes its tensors hold and their peak since the last reset.
Every epoch does the same work on tensors of the same shapes, so its peak is the epoch before's;
a reference kept from one step to the next (a loss with its graph, a batch, a copy's buffer)
raises it epoch after epoch, long before the device runs out. The peak is read where an epoch's
batches end, and counted anew from there: each epoch's window holds its steps and the validation
and checkpoint of the epoch before it (the first: the model's build and restore instead).
"""

from __future__ import annotations

import torch

from ftjob import metrics as M

MIB = 2**20


def note_epoch_peak(metrics: M.MetricSet, peak_mb: float) -> None:
    """One epoch's peak folded into the metrics: the epoch's, the highest of any, and the
    largest rise over the epoch before it. The metrics ride in checkpoints, so an attempt after
    a failure compares its first epoch with the last one before it."""
    before = metrics.get(M.GPU_MEMORY_EPOCH_PEAK)
    if before:
        rise = max(metrics.get(M.GPU_MEMORY_GROWTH), peak_mb - before)
        metrics.set(M.GPU_MEMORY_GROWTH, rise)
    metrics.set(M.GPU_MEMORY_EPOCH_PEAK, peak_mb)
    metrics.set(M.GPU_MEMORY_PEAK, max(metrics.get(M.GPU_MEMORY_PEAK), peak_mb))


def epoch_ended(device: torch.device, metrics: M.MetricSet) -> None:
    """On a GPU, at the end of an epoch's batches: its peak noted, the next epoch's counted
    from here. Nothing on a CPU (the keys stay 0)."""
    if device.type != "cuda":
        return
    note_epoch_peak(metrics, torch.cuda.max_memory_allocated(device) / MIB)
    torch.cuda.reset_peak_memory_stats(device)
