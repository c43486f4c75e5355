"""Exact mode's step on 1, 2 and 4 ranks of a gloo group: the gradient's bits do not depend
on the world size. On the grid (any ``G``), nor on which path a step took -- the sum converted
against the scale the previous step agreed (and sent while the backward pass runs), or redone
with the scale agreed after it, because the scale moved, none was known yet, or the ranks'
guesses differ. In the tree (a power-of-two ``G``), nor on how the ranks' subtrees meet."""

from __future__ import annotations

import math
import socket
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftjob.worker.exact import ExactBackward
from ftjob.worker.exact_sum import GradientSum, TreeSum, Workspace
from tests.support.local_run import _rank_context

G, MICRO = 4, 4  # a global batch of 16 in four micro-batches of 4
# Each step's loss multiplier (a power of two scales every gradient exactly) and the path it
# must take: the first step knows no scale; the same step again keeps it; 2**20 and 2**-24
# move every tensor's scale up and down; 0 makes every gradient zero, and the next step moves
# up from there; a NaN loss makes the mean NaN and forgets the scale. "mixed": the last rank
# alone guesses a scale 2**8 too coarse for tensor 0 (at world 1 a guess that did not hold;
# at world 2 and 4 guesses that differ between ranks), so that tensor alone is redone.
STEPS = [
    (1.0, "all"),
    (1.0, "none"),
    (2.0**20, "all"),
    (2.0**-24, "all"),
    (0.0, "all"),
    (1.0, "all"),
    (1.0, "none"),
    (1.0, "mixed"),
    (math.nan, "none"),
    (1.0, "all"),
]
SAME_AS_FIRST = [1, 5, 6, 7, 9]  # the first step's inputs: its bits, whichever the path


class Batch:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def keep(self) -> None:
        return None


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.3),
        torch.nn.Linear(4 * 6 * 6, 5),
    )


def train(
    rank: int, world: int, tree: bool = False, micro: int = MICRO
) -> tuple[list[dict[str, np.ndarray]], list[tuple[int, ...]]]:
    """Every step of :data:`STEPS` on this rank: the parameters' mean gradients and the
    buffers after it, and the tensors each step summed again; on the grid, or with ``tree``
    in the tree; the global batch of 16 in micro-batches of ``micro``. One intra-op thread,
    as exact mode fixes (a convolution's bits depend on it)."""
    torch.set_num_threads(1)
    torch.manual_seed(1)
    images, labels = torch.randn(G * MICRO, 3, 8, 8), torch.randint(0, 5, (G * MICRO,))
    share = slice(rank * G * MICRO // world, (rank + 1) * G * MICRO // world)
    net = model()
    backward = ExactBackward(rank, world, micro, seed=3, work=Workspace(tree=tree))
    batch = Batch(images[share], labels[share])
    states, redone = [], []
    for multiplier, path in STEPS:
        sums: GradientSum = next(iter(backward.work._sums.values()), None)  # type: ignore[assignment]
        if path == "mixed" and rank == world - 1 and not tree:
            sums.guess[0] += 8
            sums.shifts[0] = (sums.shifts[0] or 0) - 8
        # The same step index: the same dropout masks, so equal inputs give equal gradients.
        loss = lambda x, y, m=multiplier: F.cross_entropy(net(x), y) * m  # noqa: E731
        backward(0, net, batch, loss, lambda: None)
        state = {f"grad.{n}": p.grad.numpy().copy() for n, p in net.named_parameters()}
        state |= {n: b.numpy().copy() for n, b in net.named_buffers()}
        states.append(state)
        kind = TreeSum if tree else GradientSum
        assert [type(x) for x in backward.work._sums.values()] == [kind]
        redone.append(next(iter(backward.work._sums.values())).redone)
    return states, redone


def rank_main(rank: int, world: int, port: int, out: Any, tree: bool, micro: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out.put((rank, train(rank, world, tree, micro)))
    finally:
        dist.destroy_process_group()


def on_ranks(
    world: int, tree: bool = False, micro: int = MICRO
) -> list[tuple[list[dict[str, np.ndarray]], list[tuple[int, ...]]]]:
    ctx = _rank_context()
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, out, tree, micro)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    return [results[r] for r in range(world)]


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray], only: str = "") -> list[str]:
    """The names (starting with ``only``) whose arrays differ in a bit (NaN equal to NaN of
    the same pattern)."""
    assert a.keys() == b.keys()
    return [n for n in a if n.startswith(only) and a[n].tobytes() != b[n].tobytes()]


def test_the_gradient_has_the_same_bits_at_world_1_2_and_4_and_on_either_path():
    threads = torch.get_num_threads()
    try:
        states, redone = train(0, 1)
    finally:
        torch.set_num_threads(threads)
    tensors = len(list(model().parameters()))
    for (_, path), got in zip(STEPS, redone, strict=True):
        expected = {"all": tensors, "none": 0}.get(path, 1)
        assert len(got) == expected, (path, got)
    assert redone[7] == (0,)
    # The fast path and the redone sum agree bit for bit on equal inputs (the buffers move
    # on: BatchNorm's running statistics).
    for step in SAME_AS_FIRST:
        assert same_bits(states[0], states[step], "grad.") == []
    assert all(not v.any() for n, v in states[4].items() if n.startswith("grad."))
    assert all(np.isnan(v).all() for n, v in states[8].items() if n.startswith("grad."))
    assert same_bits(states[0], states[2], "grad.") != []  # the steps differ where they should
    for world in (2, 4):
        ranks = on_ranks(world)
        for rank, (rank_states, rank_redone) in enumerate(ranks):
            # Every rank took the same path; "mixed" redid tensor 0 on all of them.
            assert rank_redone == redone, (world, rank)
            for step, (mine, theirs) in enumerate(zip(states, rank_states, strict=True)):
                assert same_bits(mine, theirs) == [], (world, rank, step)


def test_in_the_tree_the_gradient_has_the_same_bits_at_world_1_2_and_4():
    threads = torch.get_num_threads()
    try:
        states, redone = train(0, 1, tree=True)
    finally:
        torch.set_num_threads(threads)
    assert set(redone) == {()}
    for step in SAME_AS_FIRST:
        assert same_bits(states[0], states[step], "grad.") == []
    assert all(not v.any() for n, v in states[4].items() if n.startswith("grad."))
    assert all(np.isnan(v).all() for n, v in states[8].items() if n.startswith("grad."))
    assert same_bits(states[0], states[2], "grad.") != []
    # A float32 sum: not the grid's truncated one.
    grid, _ = train(0, 1)
    assert same_bits(states[0], grid[0], "grad.") != []
    for world in (2, 4):
        for rank, (rank_states, _) in enumerate(on_ranks(world, tree=True)):
            for step, (mine, theirs) in enumerate(zip(states, rank_states, strict=True)):
                assert same_bits(mine, theirs) == [], (world, rank, step)


def test_eight_micro_batches_in_the_tree_have_the_same_bits_on_1_and_8_ranks():
    # Three levels of pairs between ranks (8 ranks of one micro-batch each) against one rank
    # that adds all eight itself: the tree's every level, on the grid's steps.
    threads = torch.get_num_threads()
    try:
        states, _ = train(0, 1, tree=True, micro=2)
    finally:
        torch.set_num_threads(threads)
    for rank, (rank_states, _) in enumerate(on_ranks(8, tree=True, micro=2)):
        for step, (mine, theirs) in enumerate(zip(states, rank_states, strict=True)):
            assert same_bits(mine, theirs) == [], (rank, step)
