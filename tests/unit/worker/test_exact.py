"""Exact mode's parts: the fixed-point sum (the same bits in any order, within its stated
precision), buffers carried as bit patterns, the micro-batch split it refuses, and the
deterministic kernels it asks of a GPU."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import pytest
import torch

from ftjob.config import ConfigError, TrainerConfig
from ftjob.policy.elastic import fixed_micro_batches
from ftjob.worker.exact import (
    HEADROOM_BITS,
    buffer_bits,
    exact_sum,
    largest_magnitudes,
    pin_kernels,
    refused_op,
    set_from_bits,
)


def summed(rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    maxima = torch.stack([part.abs().amax(dim=1) for part in rows.split(lengths, dim=1)], dim=1)
    mean, rider = exact_sum(rows.clone(), maxima, lengths, rows.shape[0], world=1)
    assert rider is None
    return mean


def test_the_exact_sum_has_the_same_bits_in_any_order_and_keeps_its_precision():
    torch.manual_seed(0)
    lengths = [300, 7, 1]
    # Magnitudes over many octaves: float32 sums of these depend on the order.
    rows = torch.randn(8, sum(lengths)) * torch.logspace(-6, 3, sum(lengths))
    first = summed(rows, lengths)
    orders = [torch.randperm(8) for _ in range(5)]
    assert all(torch.equal(summed(rows[o], lengths), first) for o in orders)
    float_sums = {tuple(rows[o].sum(dim=0).tolist()) for o in orders}
    assert len(float_sums) > 1  # what the exact sum is for
    # Within its grid: per tensor, 2**(e + ceil(log2 8) - HEADROOM_BITS) per term, against an
    # exact float64 sum.
    reference = rows.double().mean(dim=0)
    for got, ref, part in zip(
        first.split(lengths), reference.split(lengths), rows.split(lengths, dim=1), strict=True
    ):
        e = math.frexp(float(part.abs().max()))[1]
        step = math.ldexp(1.0, e + 3 - HEADROOM_BITS)
        float32_rounding = ref.abs() * 2.0**-24
        assert bool(((got.double() - ref).abs() <= step + float32_rounding).all())


def test_a_tensor_with_a_non_finite_gradient_is_nan_and_a_zero_one_stays_zero():
    rows = torch.ones(2, 6)
    rows[1, 0] = math.inf
    rows[:, 4:] = 0.0
    mean = summed(rows, [2, 2, 2])
    assert bool(mean[:2].isnan().all())
    assert mean[2:4].tolist() == [1.0, 1.0]
    assert mean[4:].tolist() == [0.0, 0.0]


def test_each_tensor_largest_magnitude_is_its_infinity_norm_nan_included():
    torch.manual_seed(0)
    tensors = [torch.randn(50) * 1e-30, -torch.rand(7) - 3.0, torch.zeros(3), torch.ones(0)]
    tensors += [torch.tensor([1.0, math.nan, -2.0]), torch.tensor([-math.inf, 1.0])]
    out = torch.empty(len(tensors))
    largest_magnitudes(tensors, out=out)
    expected = torch.stack([t.abs().amax() if t.numel() else torch.tensor(0.0) for t in tensors])
    assert torch.equal(out[:4], expected[:4])
    assert math.isnan(out[4]) and out[5] == math.inf


def test_buffers_travel_as_their_bit_patterns():
    buffers = [
        torch.tensor([-1.5, math.nan, 3e-41, -0.0]),
        torch.tensor([math.pi], dtype=torch.float64),
        torch.tensor(12345678901, dtype=torch.int64),
        torch.tensor([-2.5, 7.0], dtype=torch.bfloat16),
    ]
    bits = buffer_bits(buffers, mine=True)
    assert bits.dtype == torch.int64 and bits.numel() == 8
    assert not bool(buffer_bits(buffers, mine=False).any())
    # What the all-reduce gives the other ranks: rank 0's bits plus zeros.
    received = [torch.zeros_like(b) for b in buffers]
    set_from_bits(received, bits + buffer_bits(buffers, mine=False))
    for got, sent in zip(received, buffers, strict=True):
        assert got.dtype == sent.dtype
        assert torch.equal(got.view(-1).view(torch.uint8), sent.view(-1).view(torch.uint8))


def test_a_rank_share_that_is_not_whole_micro_batches_is_refused():
    assert fixed_micro_batches(64, 16) == 4
    for rank_batch, micro in [(48, 32), (8, 16), (16, 0)]:
        with pytest.raises(ValueError, match="trainer.micro_batch_size"):
            fixed_micro_batches(rank_batch, micro)


def test_exact_mode_refuses_a_micro_batch_some_world_size_cannot_split_before_ray_starts():
    assert TrainerConfig(
        exact=True, num_workers=4, batch_size=24, min_workers=2, micro_batch_size=8
    )
    with pytest.raises(ConfigError) as err:  # 96 over 3 workers: 32 a rank, not whole 24s
        TrainerConfig(exact=True, num_workers=4, batch_size=24, min_workers=2)
    assert err.value.key == "trainer.micro_batch_size"
    assert "on 3 workers" in err.value.rule and "a divisor of 8" in err.value.rule
    with pytest.raises(ConfigError) as err:
        TrainerConfig(num_workers=2, micro_batch_size=0)
    assert err.value.key == "trainer.micro_batch_size"
    # Data parallel mode: a remainder micro-batch is allowed, as before.
    assert not TrainerConfig(num_workers=2, batch_size=32, micro_batch_size=24).exact


@pytest.fixture
def kernel_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's process-wide kernel settings, put back as they were after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn
    saved = (cudnn.deterministic, cudnn.benchmark, torch.get_num_threads())
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark, threads = saved
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)


def deterministic() -> tuple[bool, bool, bool, bool, str | None]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


@pytest.mark.usefixtures("kernel_settings")
def test_exact_mode_on_a_gpu_asks_for_deterministic_kernels_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    untouched = deterministic()
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    pin_kernels(TrainerConfig(exact=True), cpu)  # the CPU's kernels are deterministic already
    pin_kernels(TrainerConfig(use_gpu=True), gpu)  # data parallel mode keeps the fast ones
    assert deterministic() == untouched
    pin_kernels(TrainerConfig(exact=True, use_gpu=True), gpu)
    # Strict: an op without a deterministic kernel raises (a warning would let the run go on
    # to weights that depend on the world size); cuBLAS with a fixed workspace; cuDNN's
    # deterministic algorithms, none chosen by benchmarking.
    assert deterministic() == (True, False, True, False, ":4096:8")
    assert torch.get_num_threads() == 1  # trainer.resources_per_worker.CPU
    # A user's workspace setting is kept where cuBLAS is deterministic with it, else replaced.
    for preset, kept in [(":16:8", ":16:8"), (":4096:8", ":4096:8"), (":0:0", ":4096:8")]:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", preset)
        pin_kernels(TrainerConfig(exact=True, use_gpu=True), gpu)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == kept


@pytest.mark.usefixtures("kernel_settings")
def test_an_op_without_a_deterministic_kernel_is_exact_modes_fatal_error_naming_it():
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError) as err:  # put_ has none, on CPU too
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
    said = refused_op(err.value)
    assert said is not None
    assert "trainer.exact" in said and "put_ does not have a deterministic implementation" in said
    assert "\n" not in said and "warn_only" not in said  # torch's advice to turn it off: not ours
    cublas = RuntimeError(
        "Deterministic behavior was enabled with either `torch.use_deterministic_algorithms"
        "(True)` or `at::Context::setDeterministicAlgorithms(true)`, but this operation is not "
        "deterministic because it uses CuBLAS and you have CUDA >= 10.2."
    )
    said = refused_op(cublas)  # not an op to leave out: the workspace setting, named
    assert said and "CUBLAS_WORKSPACE_CONFIG" in said and "leave that op out" not in said
    assert refused_op(RuntimeError("CUDA out of memory")) is None  # a failure to retry
    assert refused_op(ValueError(str(err.value))) is None
