"""Exact mode's parts: the sum on a power-of-two grid (the same bits however ranks group the
terms, within its stated precision), buffers carried as bit patterns, the micro-batch split it refuses, and the
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
    ExactBackward,
    buffer_bits,
    pin_kernels,
    refused_op,
    set_from_bits,
)
from ftjob.worker.exact_sum import (
    SUM_BITS,
    ZERO,
    Room,
    TwiceAccumulated,
    Workspace,
    guard_bits,
    mean_from_grid,
    scale_classes,
    shift_of,
    sum_on_grid,
)


class Batch:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def keep(self) -> None:
        return None


def grid_sum(terms: list[torch.Tensor], shift: int) -> torch.Tensor:
    acc = torch.empty(terms[0].numel(), dtype=torch.float64)
    sum_on_grid(acc, terms, shift, Room.on("cpu"))
    return acc


def test_the_sum_on_the_grid_has_the_same_bits_however_ranks_group_the_terms():
    torch.manual_seed(0)
    # One tensor's 8 micro-batch gradients, magnitudes over many octaves: float32 sums of
    # these depend on the order.
    rows = torch.randn(8, 3000) * torch.logspace(-6, 3, 3000)
    total = rows.shape[0]
    top = scale_classes(rows.abs().amax().reshape(1), total)
    shift = shift_of(float(top[0]), total)
    whole = grid_sum(list(rows), shift)
    for ranks in (2, 4, 8):  # each rank sums its run; the all-reduce adds them in any order
        parts = [grid_sum(list(run), shift) for run in rows.chunk(ranks)]
        for order in (torch.randperm(ranks) for _ in range(3)):
            summed = parts[order[0]].clone()
            for i in order[1:]:
                summed += parts[i]
            assert torch.equal(summed, whole)
    float_sums = {tuple(rows[torch.randperm(8)].sum(dim=0).tolist()) for _ in range(5)}
    assert len(float_sums) > 1  # what the grid is for


def test_the_mean_keeps_its_stated_precision():
    torch.manual_seed(1)
    rows = torch.randn(4, 5000) * torch.logspace(-9, 2, 5000)
    total, largest = rows.shape[0], float(rows.abs().max())
    top = float(scale_classes(torch.tensor([largest]), total)[0])
    shift = shift_of(top, total)
    grid = math.ldexp(1.0, -shift)
    # The grid: at most the largest magnitude times 2**(guard - 45).
    assert grid <= largest * 2.0 ** (guard_bits(total) - 45)
    assert largest < 2.0**top and shift == SUM_BITS - guard_bits(total) - top
    mean = torch.empty(rows.shape[1])
    mean_from_grid(grid_sum(list(rows), shift), shift, total, mean, Room.on("cpu"))
    exact = rows.double().mean(dim=0)  # float64 holds these sums of four float32s exactly
    # Below one grid step a term (truncation), then float32's rounding of the mean.
    assert bool(((mean.double() - exact).abs() <= grid + exact.abs() * 2.0**-24).all())
    # Every element within 2**(22 - guard) of the largest keeps all of its float32 bits.
    near = rows.abs().amin(dim=0) >= largest * 2.0 ** (guard_bits(total) - 22)
    assert bool(near.any())
    kept = grid_sum(list(rows[:, near]), shift) * grid
    assert torch.equal(kept, rows[:, near].double().sum(dim=0))


def test_scale_classes_step_in_octaves_of_8_with_zero_and_non_finite_apart():
    maxima = torch.tensor([1.0, 1.5, 0.99, 2.0**-8, 3e-41, 0.0, math.inf, math.nan, 300.0])
    classes = scale_classes(maxima, 4).tolist()
    assert classes[:5] == [8.0, 8.0, 0.0, 0.0, -128.0]  # the multiple of 8 above log2(M)
    assert classes[5] == ZERO and math.isnan(classes[6]) and math.isnan(classes[7])
    assert classes[8] == 16.0
    # A gradient below float32's normal range still scales exactly (two steps past 2**126).
    tiny = torch.tensor([3e-41, -2.5e-40])
    shift = shift_of(-128.0, 4)
    assert shift > 126
    assert torch.equal(grid_sum([tiny], shift), torch.trunc(tiny.double() * 2.0**shift))


def test_buffers_travel_as_their_bit_patterns():
    buffers = [
        torch.tensor([-1.5, math.nan, 3e-41, -0.0]),
        torch.tensor([math.pi], dtype=torch.float64),
        torch.tensor(12345678901, dtype=torch.int64),
        torch.tensor([-2.5, 7.0], dtype=torch.bfloat16),
    ]
    bits = buffer_bits(buffers, mine=True, device="cpu")
    assert bits.dtype == torch.int64 and bits.numel() == 8
    assert not bool(buffer_bits(buffers, mine=False, device="cpu").any())
    # What the all-reduce gives the other ranks: rank 0's bits plus zeros.
    received = [torch.zeros_like(b) for b in buffers]
    set_from_bits(received, bits + buffer_bits(buffers, mine=False, device="cpu"))
    for got, sent in zip(received, buffers, strict=True):
        assert got.dtype == sent.dtype
        assert torch.equal(got.view(-1).view(torch.uint8), sent.view(-1).view(torch.uint8))


def test_the_buffers_bits_lie_on_the_collectives_device_on_every_rank():
    # NCCL takes no CPU tensor: rank 0's bits and the other ranks' zeros go where the model is
    # (the meta device stands in for a GPU here); a model without buffers sends nothing.
    buffers = [torch.tensor([1.0, 2.0]), torch.tensor(3, dtype=torch.int64)]
    for mine in (True, False):
        assert buffer_bits(buffers, mine, device="meta").device.type == "meta"
        assert buffer_bits([], mine, device="meta").shape == (0,)


@pytest.mark.parametrize("tree", [True, False])
def test_a_gradient_accumulated_twice_in_one_backward_is_a_fatal_error_naming_the_fix(
    tree: bool,
):
    # A layer used inside a reentrant activation checkpoint and again outside it: autograd
    # accumulates its gradient twice in one backward pass, which exact mode would half sum.
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        inner = torch.utils.checkpoint.checkpoint(layer, x.requires_grad_(), use_reentrant=True)
        return torch.nn.functional.mse_loss(layer(inner), y)

    batch = Batch(torch.randn(8, 4), torch.randn(8, 4))
    backward = ExactBackward(0, 1, 4, seed=0, work=Workspace(tree=tree))
    with pytest.raises(TwiceAccumulated) as err:
        backward(0, layer, batch, loss_of, lambda: None)
    assert refused_op(err.value) == str(err.value)
    assert "use_reentrant=False" in str(err.value)
    # Without the reentrant checkpoint the same step runs.
    plain = lambda x, y: torch.nn.functional.mse_loss(layer(layer(x)), y)  # noqa: E731
    backward(1, layer, batch, plain, lambda: None)
    assert layer.weight.grad is not None and bool(layer.weight.grad.any())


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


def test_exact_mode_says_which_sum_its_micro_batch_count_takes():
    tree = TrainerConfig(exact=True, num_workers=2, batch_size=32, micro_batch_size=16)
    assert tree.exact_note is not None and "4 micro-batches of 16" in tree.exact_note
    assert "float32 in one fixed tree" in tree.exact_note
    grid = TrainerConfig(exact=True, num_workers=2, batch_size=24, micro_batch_size=8)
    assert grid.exact_note is not None and "6 micro-batches of 8" in grid.exact_note
    assert "not a power of two" in grid.exact_note and "on a grid" in grid.exact_note
    assert TrainerConfig(num_workers=2).exact_note is None


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
