"""The cluster a run joins: refusing an address where no cluster answers, keeping Ray's
raylet-death dumps out of the user's console (no Ray started), and the settings a simulated
cluster starts with (one real start)."""

from __future__ import annotations

import io
import socket
from typing import Any

import pytest
from hydra.core.global_hydra import GlobalHydra

from ftjob.config import JobError, load_job, register_schema
from ftjob.config.compose import Composer, Target
from ftjob.driver import cluster
from ftjob.driver.cluster import _RayNoiseFilter, probe_cluster


def test_an_address_where_nothing_answers_is_refused_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        with pytest.raises(JobError) as err:
            probe_cluster(f"127.0.0.1:{port}", timeout=2)
    assert f"ray.address='127.0.0.1:{port}': no Ray cluster answers" in str(err.value)
    assert "ray start --head" in str(err.value)


def test_auto_without_a_cluster_on_this_machine_says_what_auto_means(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "RAY_CURRENT_CLUSTER", str(tmp_path / "none"))
    with pytest.raises(JobError, match="no running Ray cluster found on this machine"):
        probe_cluster("auto")
    stale = tmp_path / "ray_current_cluster"
    stale.write_text("127.0.0.1:1")  # a cluster that died long ago
    monkeypatch.setattr(cluster, "RAY_CURRENT_CLUSTER", str(stale))
    with pytest.raises(JobError, match=r"at 127\.0\.0\.1:1 \(from ray.address='auto'\)"):
        probe_cluster("auto", timeout=2)
    with pytest.raises(JobError, match="expected HOST:PORT"):
        probe_cluster("not-an-address")


def test_raylet_death_reports_fold_into_one_line_and_retried_tasks_into_none():
    out = io.StringIO()
    noise = _RayNoiseFilter(out)
    noise.write("[ftjob] 00:10 step 10\n")
    noise.write(
        "(raylet) The node with node id: ab12 has been marked dead because the detector has "
        "missed too many heartbeats from it. This can happen when a \t(1) raylet crashes\n"
        "\t(2) raylet has lagging heartbeats due to slow network or busy workload.\n"
    )
    noise.write(
        "\x1b[33m(raylet)\x1b[0m Task _map_task failed. There are infinite retries remaining, so "
        "the task will be retried. Error: Task failed because the node it was running on is dead "
        "or unavailable. Node IP: 192.0.2.2, node ID: a7be.\n"
    )
    noise.write("[ftjob] 00:20 step 20\n")
    assert out.getvalue().splitlines() == [
        "[ftjob] 00:10 step 10",
        "[ftjob] ray: a raylet died (its node is gone); details in Ray's session logs",
        "[ftjob] 00:20 step 20",
    ]


def test_on_an_embedded_ray_a_raylet_death_is_said_to_be_rays_own():
    out = io.StringIO()
    noise = _RayNoiseFilter(out, embedded=True)
    noise.write("(raylet) Raylet is terminated. Termination is unexpected.\n")
    assert out.getvalue().splitlines() == [
        "[ftjob] ray: the embedded Ray's raylet died (Ray itself is gone with it); details in "
        "Ray's session logs"
    ]


@pytest.mark.ray
def test_a_simulated_cluster_gets_the_configured_pull_timeout_and_node_health_checks():
    # A restarted worker would otherwise wait Ray's 10 s on a copy held by a just-killed node,
    # and Ray would mark a killed node dead only after 3 s x 5 failed health checks.
    from ray._raylet import Config

    register_schema()
    try:
        overrides = [
            "ray.local_nodes=2",
            "ray.node_cpus=1",
            "ray.object_pull_timeout_ms=1500",
            "ray.health_check_period_ms=700",
            "ray.health_check_failure_threshold=2",
        ]
        job = load_job(Composer().compose(Target("test"), overrides))
    finally:
        GlobalHydra.instance().clear()
    with cluster.cluster(job) as local:
        assert local is not None and len(local.cluster.list_all_nodes()) == 2
        assert Config.object_manager_pull_timeout_ms() == 1500  # what GCS gave this driver
        assert Config.health_check_period_ms() == 700
        assert Config.health_check_failure_threshold() == 2


def test_the_trainer_leaves_out_ray_trains_dataset_integration_and_keeps_the_rest():
    # ftjob streams its own data; Ray Train's integration would start an idle DatasetManager
    # actor with every attempt. Everything else Ray Train sets up stays.
    import ray.train

    from ftjob.driver.runner import _torch_trainer

    trainer = _torch_trainer()(lambda config: None, scaling_config=ray.train.ScalingConfig())
    names = {type(c).__name__ for c in trainer._create_default_callbacks()}
    assert "DatasetsCallback" not in names
    assert {"BackendSetupCallback", "PlacementGroupCleanerCallback"} <= names


@pytest.mark.ray
def test_decode_tasks_are_asked_for_only_where_batches_decode_in_ray_data() -> None:
    import ray

    from ftjob.worker.context import _ray_machine
    from tests.support.jobs import compose_job

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        one = ("+experiment=digits_ft", "trainer.num_workers=1")
        # One worker of 1 CPU and its decode task of 1: more than the cluster's one CPU.
        with pytest.raises(JobError, match=r"need 2: .*trainer\.decode_in=worker"):
            cluster.check_resources(compose_job(*one))
        cluster.check_resources(compose_job(*one, "trainer.decode_in=worker"))  # fits
        # What auto decides on: this process's CPUs, and a cluster of this one machine.
        cores, one_machine = _ray_machine()
        assert cores >= 1 and one_machine
    finally:
        ray.shutdown()


@pytest.mark.ray
def test_an_elastic_runs_claim_on_the_cluster_is_the_runs_so_a_dead_drivers_gives_way() -> None:
    """Ray Train claims an elastic group's resources in Ray's shared autoscaling coordinator,
    served oldest first; a driver killed outright never withdraws its claim (it lapses 180 s
    after its last renewal). Under one id per Ray Train run the next driver of the run was
    left no capacity to grow; under the run's identity its claim takes the dead one's place."""
    import ray
    from ray.train import ScalingConfig

    from ftjob.driver.scaling import FtjobElasticPolicy

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1})
        ledger: Any = None  # not asked: no group runs

        def started(requester_id: str) -> int:
            """A driver's policy, registered: how many workers it sees room for."""
            policy = FtjobElasticPolicy(config, ledger, requester_id)
            policy.after_controller_start(None)
            return int(policy._count_possible_workers(policy._get_reserved_resources()))

        assert started("ftjob-run@00000000000000aa") == 2  # then killed: never withdrawn
        assert started("ftjob-other@00000000000000bb") == 0  # another claim: served after it
        assert started("ftjob-run@00000000000000aa") == 2  # the same run's next driver
    finally:
        ray.shutdown()
