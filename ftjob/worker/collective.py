"""Collectives the training workers share outside the training step."""

from __future__ import annotations

from typing import Any


def broadcast(obj: Any, world_size: int) -> Any:
    """``obj`` from rank 0 on every rank (a picklable object, through the process group)."""
    if world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (picklable objects)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
