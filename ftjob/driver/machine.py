"""What this machine really has, for the clusters ftjob starts on it: the cores this process may
run on -- its CPU affinity and its cgroup's CPU quota (v1 or v2) -- and the memory its cgroup
allows. Not what a Ray started here is told it has: ftjob sizes the embedded Ray itself, and a
simulated cluster's nodes have the CPUs ``ray.node_cpus`` declares, so a check against Ray's
resources alone passes a job the machine can only thrash on (a container of 2 cores reports
the host's in ``os.cpu_count()``)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
MEMBERSHIP = "/proc/self/cgroup"


@dataclass(frozen=True)
class Machine:
    """What this machine has, for the clusters ftjob starts on it."""

    cpus: int
    gpus: int
    memory: float  # bytes

    @classmethod
    def here(cls) -> Machine:
        import torch

        return cls(usable_cpus(), torch.cuda.device_count(), usable_memory())


def usable_cpus(root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> int:
    """The cores this process may run on: its CPU affinity, within its cgroup's CPU quota
    (rounded up: 1.5 cores of quota run two processes at three quarters of a core)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cores = os.cpu_count() or 1
    quota = min(_cpu_quotas(root, membership), default=None)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else max(1, cores)


def usable_memory(root: str = CGROUP_ROOT, membership: str = MEMBERSHIP) -> float:
    """Bytes of memory this process's cgroup may use: the machine's, or its cgroup's limit
    where lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(min([physical, *_memory_limits(root, membership)]))


def _cgroup_dirs(root: str, membership: str, controller: str) -> Iterator[str]:
    """The directories of this process's cgroup and of its ancestors (a limit on any of them
    applies) that exist here: under ``controller``'s mount (cgroup v1) and the unified
    hierarchy (v2, at the root or at ``unified/``). In a container the path ``membership``
    names may be the host's; the mount's own root -- the container's cgroup then -- is always
    looked at."""
    v1 = v2 = "/"
    for line in (_read(membership) or "").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    mounts = ((os.path.join(root, controller), v1), (root, v2), (os.path.join(root, "unified"), v2))
    seen = set()
    for mount, path in mounts:
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            here = os.path.join(mount, *parts[:depth])
            if here not in seen and os.path.isdir(here):
                seen.add(here)
                yield here


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_quotas(root: str, membership: str) -> Iterator[float]:
    """Each CPU quota, in cores, set on this process's cgroup or an ancestor."""
    for here in _cgroup_dirs(root, membership, "cpu"):
        v2 = _read(os.path.join(here, "cpu.max"))
        if v2:
            quota, _, period = v2.partition(" ")
            if quota != "max" and quota.isdigit() and period.isdigit() and int(period):
                yield int(quota) / int(period)
            continue
        quota_us = _read(os.path.join(here, "cpu.cfs_quota_us"))
        period_us = _read(os.path.join(here, "cpu.cfs_period_us"))
        if quota_us and period_us and quota_us.isdigit() and period_us.isdigit():
            if int(quota_us) > 0 and int(period_us) > 0:  # v1: -1 is no quota
                yield int(quota_us) / int(period_us)


def _memory_limits(root: str, membership: str) -> Iterator[int]:
    """Each memory limit, in bytes, set on this process's cgroup or an ancestor (v1's "no
    limit" is a huge number: the machine's memory is lower)."""
    for here in _cgroup_dirs(root, membership, "memory"):
        for name in ("memory.max", "memory.limit_in_bytes"):
            value = _read(os.path.join(here, name))
            if value and value.isdigit():
                yield int(value)
