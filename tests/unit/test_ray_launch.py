"""Ray launcher decisions without a Ray cluster: which cluster to join, rank bundles, the CUDA
device of a rank from the GPUs Ray assigned to it."""

from __future__ import annotations

import pytest

from trainer.config import TrainerConfig
from trainer.ranks.ray_config import RayLaunchConfig
from trainer.ranks.ray_launch import local_rank_of, rank_bundles, resolve_address


def test_joins_the_jobs_cluster_when_ray_address_is_set():
    cfg = RayLaunchConfig()
    assert resolve_address(cfg, {"RAY_ADDRESS": "10.0.0.5:6379"}) == "10.0.0.5:6379"
    assert resolve_address(cfg, {}) is None  # private local Ray (r3flow local, tests)
    assert resolve_address(RayLaunchConfig(address="local"), {"RAY_ADDRESS": "x:1"}) is None
    assert resolve_address(RayLaunchConfig(address="auto"), {}) == "auto"


def test_one_bundle_per_rank_with_gpus_only_where_the_cluster_has_them():
    cfg = RayLaunchConfig(cpus_per_rank=2)
    assert rank_bundles(cfg, 2, cluster_gpus=0) == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert rank_bundles(cfg, 2, cluster_gpus=16) == [{"CPU": 2.0, "GPU": 1}] * 2
    assert rank_bundles(RayLaunchConfig(gpus_per_rank=0), 1, cluster_gpus=8) == [{"CPU": 1.0}]


@pytest.mark.parametrize(("gpu_ids", "visible", "want"), [
    ([], None, 0),          # CPU rank
    ([3], "3", 0),          # Ray narrowed CUDA_VISIBLE_DEVICES to the assigned GPU
    ([3], "0,1,2,3", 3),    # all visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)
    ([5], None, 5),
])
def test_local_rank_is_the_assigned_gpu_among_the_visible_ones(gpu_ids, visible, want):
    assert local_rank_of(gpu_ids, visible) == want


def test_trainer_config_takes_the_ray_section():
    cfg = TrainerConfig.model_validate({"run": {"launcher": "ray", "world_size": 2},
                                        "ray": {"placement_strategy": "STRICT_SPREAD"}})
    assert cfg.ray.placement_strategy == "STRICT_SPREAD" and cfg.weight_sync.advertise_addr == ""
    with pytest.raises(ValueError, match="placement_strategy"):
        TrainerConfig.model_validate({"ray": {"placement_strategy": "ANYWHERE"}})


def test_cluster_addresses_refuse_loopback():
    from trainer.ranks.ray_launch import check_cluster_addresses

    ok = TrainerConfig.model_validate({"data": {"store": "r3flow-store:50051"},
                                       "run": {"metrics_host": "0.0.0.0"}})
    check_cluster_addresses(ok)  # a Service name, all interfaces: fine
    with pytest.raises(ValueError, match=r"data\.store='127\.0\.0\.1'.*run\.metrics_host"):
        check_cluster_addresses(TrainerConfig())  # both defaults are loopback
    bad = ok.model_copy(update={"weight_sync": ok.weight_sync.model_copy(
        update={"advertise_addr": "localhost"})})
    with pytest.raises(ValueError, match=r"weight_sync\.advertise_addr='localhost'"):
        check_cluster_addresses(bad)
    v6 = ok.model_copy(update={"data": ok.data.model_copy(update={"store": "[::1]:50051"})})
    with pytest.raises(ValueError, match=r"data\.store='\[::1\]'"):
        check_cluster_addresses(v6)
