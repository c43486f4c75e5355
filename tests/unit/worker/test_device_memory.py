"""The GPU memory figures: each epoch's peak folded into the run's, and a rise between epochs
kept as the run's growth (ftjob/worker/device_memory.py)."""

import pytest
import torch

from ftjob import metrics as M
from ftjob.worker.device_memory import epoch_ended, note_epoch_peak


def figures(metrics: M.MetricSet) -> tuple[float, float, float]:
    keys = (M.GPU_MEMORY_EPOCH_PEAK, M.GPU_MEMORY_PEAK, M.GPU_MEMORY_GROWTH)
    return tuple(metrics.get(k) for k in keys)


def test_flat_epochs_leave_no_growth_and_a_first_epoch_above_the_rest_is_no_rise():
    metrics = M.MetricSet()
    for peak in (5200.0, 5100.0, 5100.0):  # the first epoch held the build's tensors too
        note_epoch_peak(metrics, peak)
    assert figures(metrics) == (5100.0, 5200.0, 0.0)


def test_a_peak_that_rises_between_epochs_is_the_runs_growth():
    metrics = M.MetricSet()
    for peak in (5000.0, 5040.0, 5100.0, 5090.0):
        note_epoch_peak(metrics, peak)
    # the largest rise of an epoch over the one before it (60), not the last epoch's (-10)
    assert figures(metrics) == (5090.0, 5100.0, 60.0)


def test_an_attempt_after_a_failure_compares_with_the_epoch_its_checkpoint_carried():
    before = M.MetricSet()
    note_epoch_peak(before, 5000.0)
    restored = M.MetricSet()
    restored.load_state_dict(before.state_dict())  # the metrics ride in the checkpoint
    note_epoch_peak(restored, 5300.0)
    assert figures(restored) == (5300.0, 5300.0, 300.0)


def test_a_cpu_worker_leaves_the_gpu_keys_at_zero():
    metrics = M.MetricSet()
    epoch_ended(torch.device("cpu"), metrics)
    assert figures(metrics) == (0.0, 0.0, 0.0)
    assert {M.GPU_MEMORY_EPOCH_PEAK, M.GPU_MEMORY_PEAK, M.GPU_MEMORY_GROWTH} <= set(M.METRIC_KEYS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tensor_kept_from_one_epoch_to_the_next_shows_as_growth_on_a_gpu():
    device, metrics, kept = torch.device("cuda"), M.MetricSet(), []
    for epoch in range(3):
        work = torch.ones(2**20, device=device)  # an epoch's work: 4 MiB, freed at its end
        kept.append(torch.ones(2**18 * (epoch + 1), device=device))  # a leak: 1, 2, 3 MiB
        del work
        epoch_ended(device, metrics)
    assert metrics.get(M.GPU_MEMORY_GROWTH) >= 1.9
