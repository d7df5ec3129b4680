"""`RayLaunchConfig`: where the trainer's rank actors run and what each reserves (the config of
trainer.ranks.ray_launch, kept apart so trainer.config imports no runtime module)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config import StrictConfig


class RayLaunchConfig(StrictConfig):
    """Where the rank actors run and what each one reserves."""

    address: str = Field(
        "", description="Ray cluster to join: '' = RAY_ADDRESS when set (a RayJob's driver), "
        "else a private local Ray; 'local' = always a private local Ray; or an address "
        "(host:port, 'auto')")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement group strategy of the rank bundles; PACK keeps an EP "
        "group on as few nodes as fit it")
    cpus_per_rank: float = Field(1.0, gt=0, description="CPUs in each rank's bundle")
    gpus_per_rank: int | None = Field(
        None, ge=0, description="GPUs in each rank's bundle (None: 1 when the cluster has GPUs, "
        "else 0)")
    placement_timeout_s: float = Field(
        600.0, gt=0, description="fail when the cluster cannot place every rank in this time")
