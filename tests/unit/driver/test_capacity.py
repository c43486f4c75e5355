"""Whether a job fits the cluster it runs on, decided before it can wait forever: a cluster
ftjob starts on this machine is refused before Ray starts; an existing one is waited for, for
``ray.resources_timeout`` seconds (no Ray: the machine and the nodes are given)."""

from __future__ import annotations

import pytest

from ftjob.config import JobError
from ftjob.driver.cluster import (
    Machine,
    check_machine,
    oversubscribed_note,
    shortfall,
    wait_for_resources,
)
from ftjob.driver.machine import usable_cpus, usable_memory
from tests.support.jobs import compose_job
from tests.support.processes import ray_temp_dir, run_ftjob

GIB = 2.0**30
TWO_CORES = Machine(cpus=2, gpus=0, memory=8 * GIB)


def job(*overrides: str):
    return compose_job("+experiment=digits_ft", "chaos=disabled", *overrides)


@pytest.mark.parametrize(
    "overrides, said",
    [
        (  # a simulated node of 1 CPU cannot hold a worker of 2 (the total of 2 CPUs could)
            (
                "ray.local_nodes=3",
                "ray.node_cpus=1",
                "trainer.num_workers=1",
                "trainer.decode_in=worker",
                "trainer.resources_per_worker.CPU=2",
            ),
            "trainer.resources_per_worker.CPU=2: each worker needs 2 CPU, and no node of the "
            "simulated cluster (2 nodes of ray.node_cpus=1) has that much (the largest: 1 CPU)",
        ),
        (  # more workers than the simulated nodes hold
            ("ray.local_nodes=3", "trainer.num_workers=6", "trainer.decode_in=worker"),
            "trainer.num_workers=6: 6 workers of {'CPU': 1.0} do not fit on the simulated "
            "cluster (2 nodes of ray.node_cpus=2), which holds 4",
        ),
        (  # the embedded Ray's CPUs, set by hand
            ("ray.num_cpus=2", "trainer.num_workers=4", "trainer.decode_in=worker"),
            "trainer.num_workers=4: 4 workers of {'CPU': 1.0} do not fit on this machine's "
            "embedded Ray (2 CPUs), which holds 2",
        ),
        (  # memory beyond the machine's
            ("+trainer.resources_per_worker.memory=17179869184",),
            "trainer.resources_per_worker.memory=17179869184: each worker needs 16.0 GiB, and no "
            "node of this machine's embedded Ray",
        ),
        (  # a resource no node of a cluster ftjob starts has
            ("+trainer.resources_per_worker.TPU=1",),
            "trainer.resources_per_worker.TPU=1: each worker needs 1 TPU, and no node",
        ),
    ],
)
def test_a_job_a_cluster_started_here_can_never_place_is_refused_before_ray(overrides, said):
    with pytest.raises(JobError) as err:
        check_machine(job(*overrides), TWO_CORES)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_job_that_fits_the_machine_passes():
    check_machine(job(), TWO_CORES)  # embedded: its CPUs are sized to the job
    check_machine(job("ray.local_nodes=3", "trainer.decode_in=worker"), TWO_CORES)


@pytest.mark.parametrize(
    "overrides, said",
    [
        (  # the embedded Ray is told 2 + 32 CPUs: Ray would start 32 workers on 2 cores
            ("trainer.num_workers=32",),
            "trainer.num_workers=32: 32 workers x 1 cores (trainer.resources_per_worker.CPU=1) "
            "need 32 cores, and this machine has 2 (its CPU affinity and cgroup quota)",
        ),
        (  # each worker's reservation is real cores
            ("trainer.resources_per_worker.CPU=2",),
            "trainer.num_workers=2: 2 workers x 2 cores (trainer.resources_per_worker.CPU=2) "
            "need 4 cores, and this machine has 2",
        ),
        (  # a simulated cluster declares its CPUs; a training process needs a real core
            ("ray.local_nodes=9", "ray.node_cpus=4", "trainer.num_workers=8"),
            "trainer.num_workers=8: 8 training processes, a core each need 8 cores, and this "
            "machine has 2",
        ),
    ],
)
def test_more_workers_than_the_machines_cores_are_refused_unless_oversubscribe_says_so(
    overrides, said
):
    with pytest.raises(JobError) as err:
        check_machine(job(*overrides), TWO_CORES)
    assert said in str(err.value) and "\n" not in str(err.value)
    assert "or set ray.oversubscribe=true to share the cores" in str(err.value)
    shared = job(*overrides, "ray.oversubscribe=true")
    check_machine(shared, TWO_CORES)
    note = oversubscribed_note(shared, TWO_CORES)  # what the run's first line adds
    assert note.startswith(" (sharing the cores, ray.oversubscribe=true: trainer.num_workers=")
    assert said.split(" (its")[0] in note
    assert oversubscribed_note(job(), TWO_CORES) == ""


def test_too_many_workers_exit_2_with_one_line_before_ray_starts(tmp_path):
    ray_env, ray_started = ray_temp_dir(tmp_path)
    workers = usable_cpus() * 4
    proc, _ = run_ftjob(
        ["+experiment=digits_ft", f"trainer.num_workers={workers}"], tmp_path, 120, ray_env
    )
    assert proc.returncode == 2, proc.stderr
    assert not ray_started.exists()  # refused before Ray started
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"ftjob: error: trainer.num_workers={workers}: {workers} workers")
    assert f"and this machine has {usable_cpus()}" in line


def cgroup(tmp_path, files: dict[str, str], membership: str) -> tuple[str, str]:
    """A cgroup tree written by hand: (its root, the process's membership file)."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return str(root), str(tmp_path / "membership")


def test_the_machines_cores_and_memory_are_its_cgroups_where_it_limits_them(tmp_path):
    # cgroup v2: a quota of half a core and 1 GiB on the process's own cgroup.
    v2 = cgroup(
        tmp_path / "v2",
        {"job/cpu.max": "50000 100000\n", "job/memory.max": "1073741824\n", "cpu.max": "max"},
        "0::/job\n",
    )
    assert usable_cpus(*v2) == 1 and usable_memory(*v2) == GIB
    # cgroup v1: the quota on an ancestor of the process's cgroup applies to it.
    v1 = cgroup(
        tmp_path / "v1",
        {
            "cpu/kube/cpu.cfs_quota_us": "100000",
            "cpu/kube/cpu.cfs_period_us": "100000",
            "cpu/kube/pod/cpu.cfs_quota_us": "-1",
            "cpu/kube/pod/cpu.cfs_period_us": "100000",
        },
        "4:cpu,cpuacct:/kube/pod\n3:memory:/kube/pod\n",
    )
    assert usable_cpus(*v1) == 1
    # In a container the named path is the host's: the mount's own root is the container's.
    container = cgroup(tmp_path / "c", {"cpu.max": "100000 100000"}, "0::/host/path\n")
    assert usable_cpus(*container) == 1
    # No limit anywhere: the cores this process may run on.
    assert usable_cpus(*cgroup(tmp_path / "none", {"cpu.max": "max 100000"}, "0::/\n")) >= 1


def test_a_memory_tier_larger_than_the_machine_is_refused_before_its_ring_is_reserved():
    big = job("checkpoint.memory.enabled=true", "checkpoint.memory.max_mb=16384")
    with pytest.raises(
        JobError,
        match=r"checkpoint.memory.max_mb=16384: more than this machine's memory \(8192 MB\)",
    ):
        check_machine(big, TWO_CORES)
    check_machine(job("checkpoint.memory.enabled=true", "checkpoint.memory.max_mb=1024"), TWO_CORES)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


EXISTING = ("ray.address=auto", "checkpoint.storage_path=s3://bucket/runs")


def test_an_existing_cluster_too_small_is_asked_to_grow_said_and_given_up_on_in_time():
    clock, lines, asked = Clock(), [], []
    small = [{"CPU": 2.0, "memory": GIB}]
    j = job(*EXISTING, "trainer.num_workers=4", "ray.resources_timeout=120")
    with pytest.raises(JobError) as err:
        wait_for_resources(
            j, lambda: small, lines.append, lambda: asked.append(1), clock, clock.sleep
        )
    assert "gave up after waiting 120 s for the cluster to grow (ray.resources_timeout=120)" in str(
        err.value
    )
    assert "trainer.num_workers=4: 4 workers" in str(err.value)
    assert asked == [1] and clock.now == 120.0
    assert len(lines) == 2 and lines[0].startswith("waiting for resources (asked of the cluster's")


def test_an_existing_cluster_that_grows_in_time_starts_the_job():
    clock, lines = Clock(), []
    nodes = [{"CPU": 2.0}]

    def grown() -> list[dict[str, float]]:
        return nodes + [{"CPU": 8.0}] if clock.now >= 30 else nodes

    j = job(*EXISTING, "trainer.num_workers=4")
    wait_for_resources(j, grown, lines.append, lambda: None, clock, clock.sleep)
    assert clock.now == 30.0 and len(lines) == 1
    assert shortfall(j, grown(), "the cluster") is None


def test_the_autoscaler_request_is_withdrawn_once_the_wait_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A request stands until replaced: left behind, it would keep the user's cluster large.
    import ray

    from ftjob.driver import cluster

    clock, requests = Clock(), []
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    monkeypatch.setattr(cluster, "_ask_autoscaler", requests.append)
    j = job(*EXISTING, "trainer.num_workers=4", "ray.resources_timeout=60")
    with pytest.raises(JobError, match="gave up after waiting 60 s"):
        cluster.check_resources(j, lambda line: None, clock, clock.sleep)
    assert len(requests) == 2 and len(requests[0]) == 4 and requests[1] == []
