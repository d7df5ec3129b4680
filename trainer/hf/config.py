"""HFBackendConfig: the knobs of the HF/FSDP2 backend that TrainerConfig does not have.

`SECTIONS` registers it as TrainerConfig's `hf` section (trainer.registry). Everything shared
with the megatron backend (model dir, dtype, optimizer, loss, replay mode and
agreement floor, data cutting, run bookkeeping) stays in trainer.config.TrainerConfig.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from services.common.config import StrictConfig
from trainer.megatron.config import model_section

if TYPE_CHECKING:  # trainer.config loads this module by name while it builds TrainerConfig
    from trainer.config import HFSection, TrainerConfig


class HFBackendConfig(StrictConfig):
    """`r3flow train --backend hf` extras (defaults suit the CPU tiny MoE)."""

    packing: bool = Field(True, description="pack each micro-batch's samples into one unpadded "
                          "row (position ids restart per sample) instead of padding to [B, S]")
    fsdp: Literal["auto", "off"] = Field(
        "auto", description="auto: FSDP2 fully_shard (per decoder layer + root) when the world "
        "has more than one rank or dtype is bf16 (fp32 master weights); off: plain module "
        "(world size 1 only)")
    sharding: Literal["full", "hybrid"] = Field(
        "full", description="full: FSDP2 shards every weight over all ranks; hybrid (HSDP): "
        "shard within groups of hf.shard_group_size ranks (a node), replicate across groups")
    shard_group_size: int = Field(
        0, ge=0, description="hybrid: ranks per shard group (the GPUs of one node; must divide "
        "run.world_size); 0 = the whole world (then hybrid is full)")
    meta_init: bool = Field(
        True, description="build the model on the meta device, shard it, then read only this "
        "rank's shards from the checkpoint (no rank holds the full model); false: every rank "
        "loads the full model with from_pretrained, then shards it")
    unsharded_grad_accumulation: bool = Field(
        False, description="FSDP2: keep the gradients of an update's micro-batches unsharded "
        "and reduce-scatter once at its end (fewer collectives, but every rank holds a "
        "full-model gradient); false: reduce-scatter after every micro-batch (sharded)")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered params after "
                                        "forward (ZeRO-3) instead of keeping them (ZeRO-2)")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention implementation")
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers in "
                                         "backward (the routers replay the same ids again)")
    sequence_parallel: int = Field(
        1, ge=1, description="Ulysses sequence parallelism: groups of this many consecutive "
        "ranks train the same samples, each on 1/P of every packed row (attention all-to-alls "
        "heads for tokens; trainer.hf.ulysses); needs hf.packing and sdpa attention, must "
        "divide run.world_size and the model's attention and key/value heads")
    reference_replay: bool = Field(True, description="the KL reference model replays the same "
                                   "routing as the policy (a warning is logged when off)")

    def check_world(self, world_size: int) -> None:
        """ValueError naming the field when this sharding cannot run on `world_size` ranks."""
        if self.fsdp == "off" and world_size > 1:
            raise ValueError(f"hf.fsdp: off needs run.world_size 1 (have {world_size})")
        if self.shard_group_size and world_size % self.shard_group_size:
            raise ValueError(f"hf.shard_group_size: {self.shard_group_size} does not divide "
                             f"run.world_size {world_size}")
        if world_size % self.sequence_parallel:
            raise ValueError(f"hf.sequence_parallel: {self.sequence_parallel} does not divide "
                             f"run.world_size {world_size}")
        if self.sequence_parallel > 1 and not self.packing:
            raise ValueError("hf.sequence_parallel: needs hf.packing: true (each rank takes a "
                             "contiguous slice of one packed row)")
        if self.sequence_parallel > 1 and self.attn_implementation != "sdpa":
            raise ValueError("hf.sequence_parallel: needs hf.attn_implementation: sdpa")
        if self.shard_group_size and self.sharding != "hybrid":
            raise ValueError("hf.shard_group_size: only hybrid sharding has shard groups (set "
                             "hf.sharding: hybrid or leave it 0)")

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """FSDP2 device mesh: (shard,) for full, (replicate, shard) for hybrid."""
        if self.sharding == "full":
            return (world_size,)
        shard = self.shard_group_size or world_size
        return (world_size // shard, shard)


# The hf backend's registration (trainer.registry): the TrainerConfig section it adds and its
# checks of a whole config.
SECTIONS: dict[str, type[StrictConfig]] = {"hf": HFBackendConfig}


if TYPE_CHECKING:  # mypy: HFBackendConfig gives the planner what it reads of the section
    _NEUTRAL_VIEW: type[HFSection] = HFBackendConfig


def hf_section(cfg: TrainerConfig) -> HFBackendConfig:
    """`cfg.hf`, typed: TrainerConfig holds the section as Any (its schema is registered here,
    trainer.registry), so the hf backend reads it through this."""
    if not isinstance(cfg.hf, HFBackendConfig):
        raise TypeError(f"hf: expected an HFBackendConfig section, got {type(cfg.hf).__name__}")
    return cfg.hf


def check_trainer(cfg: TrainerConfig) -> None:
    """A TrainerConfig with backend hf: no expert parallelism; the ray world fits the sharding
    (in-process, the engine checks its process group's)."""
    if model_section(cfg).expert_parallel != 1:
        raise ValueError("model.expert_parallel: the hf backend shards experts with FSDP2 like "
                         "every other weight; EP must be 1")
    if cfg.run.launcher == "ray":
        hf_section(cfg).check_world(cfg.run.world_size)
