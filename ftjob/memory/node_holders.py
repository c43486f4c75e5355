"""A rank's view of the memory tier's holders (:mod:`ftjob.memory.cluster`): its own
node's holder, which its node's local rank 0 writes snapshots into, and its peers', which a
restore reads when its own node holds no verified copy of the chosen snapshot.

What differs between the nodes' copies of one step -- checked, not assumed: the weights and the
optimizer state are the same on every DDP rank, and so are the step, epoch and data position
(the data order follows from the seed and the position: no RNG stream to keep; the sample audit
lives in the run ledger). The module's buffers are not: each rank updates BatchNorm's running
statistics from its own slice of the batch, and DDP makes rank 0's everyone's at the next step.
Nor are the metric timers and the time in ``state.json``. That small part -- rank 0's -- is what
a snapshot needs from rank 0 to be the run's state: each copy keeps its writer's apart
(``<state>#buffers``, ``<record>#rank``, naming the writer), and rank 0 sends its own to every
peer holder with each snapshot (:func:`rank_part`), so a copy written on another node is
completed with it (:class:`~ftjob.memory.nearest_copy.NearestCopy`) and loads bit for bit what
rank 0's copy would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ftjob.memory.cluster import HolderDirectory, LocalHolders, RunHolders
from ftjob.memory.format import Buffer, unpack
from ftjob.memory.holder import HolderHandle

PER_RANK_KEYS = ("metrics", "time")  # of a record: what its writer's rank alone has
PER_RANK_SUFFIX = "#rank"
BUFFERS_SUFFIX = "#buffers"
WRITER = "writer"


@dataclass(frozen=True)
class NodeHolders:
    """Rank ``rank``'s holders: ``directory`` (a
    :class:`~ftjob.memory.cluster.HolderDirectory`, or None: the tier is off), the node
    it runs on, whether it writes that node's snapshots (its local rank 0), and the lease
    generation of its driver, which its every write to a holder carries (None: the run has no
    lease; :mod:`ftjob.memory.fence`)."""

    directory: HolderDirectory | None
    node: str
    writes: bool
    generation: int | None = None

    def local(self) -> HolderHandle | None:
        return self.directory.local(self.node) if self.directory is not None else None

    def peers(self) -> list[tuple[str, HolderHandle]]:
        return self.directory.peers(self.node) if self.directory is not None else []


class _One:
    """A directory of one holder, which every rank calls its own (one machine; tests)."""

    def __init__(self, handle: HolderHandle) -> None:
        self.handle = handle

    def local(self, node_id: str) -> HolderHandle:
        return self.handle

    def peers(self, node_id: str) -> list[tuple[str, HolderHandle]]:
        return []


def bind_holders(
    holders: Any,
    rank: int,
    node: str = "local",
    local_rank: int = 0,
    generation: int | None = None,
) -> NodeHolders:
    """``holders`` for a rank: a directory (bound to ``node``; its local rank 0 writes), an
    already bound :class:`NodeHolders`, one holder's handle (rank 0 writes), or None;
    ``generation``: its driver's lease generation."""
    if isinstance(holders, NodeHolders):
        return holders
    if holders is None or isinstance(holders, (LocalHolders, RunHolders)):
        return NodeHolders(holders, node, local_rank == 0, generation)
    return NodeHolders(_One(holders), node, rank == 0, generation)


def holders_for(holders: Any, ctx: Any, generation: int | None = None) -> NodeHolders:
    """The holders of the rank behind worker context ``ctx``. On Ray the lowest rank on each
    node writes that node's snapshots -- so rank 0 writes its own node's, and its part of the
    state reaches the peers with each of them -- found from every rank's node id, gathered
    (Ray Train's local rank counts ranks by IP address, which the nodes of a simulated cluster
    share)."""
    bound = bind_holders(holders, ctx.rank, ctx.where.node_id, ctx.local_rank, generation)
    if isinstance(holders, RunHolders):
        nodes = ctx.all_gather(ctx.where.node_id)
        writer = nodes.index(ctx.where.node_id)  # the first rank on this node
        bound = NodeHolders(holders, bound.node, writer == ctx.rank, generation)
    return bound


def split_per_rank(records: dict[str, Any], writer: int) -> dict[str, Any]:
    """A snapshot's records with each one's per-rank keys in a record of their own, which
    names the rank that wrote them (``writer``)."""
    out: dict[str, Any] = {}
    for name, record in records.items():
        if isinstance(record, dict) and any(k in record for k in PER_RANK_KEYS):
            out[name] = {k: v for k, v in record.items() if k not in PER_RANK_KEYS}
            part = {k: record[k] for k in PER_RANK_KEYS if k in record}
            out[name + PER_RANK_SUFFIX] = {**part, WRITER: writer}
        else:
            out[name] = record
    return out


def merge_per_rank(files: dict[str, Buffer]) -> dict[str, Buffer]:
    """A snapshot's files with each record whole again (its per-rank keys back in it)."""
    merged = {name: data for name, data in files.items() if not name.endswith(PER_RANK_SUFFIX)}
    for name, data in files.items():
        base = name.removesuffix(PER_RANK_SUFFIX)
        if name != base and base in merged:
            part = json.loads(bytes(data))
            part.pop(WRITER, None)
            merged[base] = json.dumps({**json.loads(bytes(merged[base])), **part}).encode()
    return merged


def split_buffers(tensors: dict[str, Any]) -> dict[str, Any]:
    """A snapshot's state dicts with a module's buffers (its state dict's entries that are no
    ``Parameter``: ``state_dict(keep_vars=True)``) in a state dict of their own."""
    import torch

    out: dict[str, Any] = {}
    for name, state in tensors.items():
        module = isinstance(state, dict) and any(
            isinstance(v, torch.nn.Parameter) for v in state.values()
        )
        if not module:
            out[name] = state
            continue
        params, buffers = type(state)(), type(state)()
        for key, value in state.items():
            (params if isinstance(value, torch.nn.Parameter) else buffers)[key] = value
        if hasattr(state, "_metadata"):  # what a module's load_state_dict reads its version from
            params._metadata = state._metadata
        out[name] = params
        if buffers:
            out[name + BUFFERS_SUFFIX] = buffers
    return out


def unpack_state(files: dict[str, Buffer], name: str, device: Any = None) -> Any:
    """The state dict a snapshot stores as ``name`` (:func:`~ftjob.memory.format.unpack`;
    ``device``: its tensors copied there), with the buffers :func:`split_buffers` kept apart
    back in it."""
    state = unpack(files, name, device)
    if f"{name}{BUFFERS_SUFFIX}" in files:
        state.update(unpack(files, f"{name}{BUFFERS_SUFFIX}"))
    return state


def rank_part(files: dict[str, Buffer]) -> dict[str, Buffer]:
    """The files of a snapshot that are its writer's own (buffers, per-rank records)."""
    return {name: data for name, data in files.items() if _per_rank(name)}


def _per_rank(name: str) -> bool:
    return name.endswith(PER_RANK_SUFFIX) or BUFFERS_SUFFIX in name


def written_by(files: dict[str, Buffer]) -> int | None:
    """The rank that wrote a snapshot (None: one without per-rank records)."""
    for name, data in files.items():
        if name.endswith(PER_RANK_SUFFIX):
            writer = json.loads(bytes(data)).get(WRITER)
            return writer if isinstance(writer, int) else None
    return None


__all__ = [
    "NodeHolders",
    "bind_holders",
    "holders_for",
    "merge_per_rank",
    "rank_part",
    "split_buffers",
    "split_per_rank",
    "unpack_state",
    "written_by",
]
