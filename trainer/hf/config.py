"""HFBackendConfig: the knobs of the HF/FSDP2 backend that TrainerConfig does not have.

Everything shared with the megatron backend (model dir, dtype, optimizer, loss, replay mode and
agreement floor, data cutting, run bookkeeping) stays in trainer.config.TrainerConfig.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config import StrictConfig


class HFBackendConfig(StrictConfig):
    """`r3flow train --backend hf` extras (defaults suit the CPU tiny MoE)."""

    packing: bool = Field(True, description="pack each micro-batch's samples into one unpadded "
                          "row (position ids restart per sample) instead of padding to [B, S]")
    fsdp: Literal["auto", "off"] = Field(
        "auto", description="auto: FSDP2 fully_shard (per decoder layer + root) when the world "
        "has more than one rank or dtype is bf16 (fp32 master weights); off: plain module "
        "(world size 1 only)")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered params after "
                                        "forward (ZeRO-3) instead of keeping them (ZeRO-2)")
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="transformers attention implementation")
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers in "
                                         "backward (the routers replay the same ids again)")
    reference_replay: bool = Field(True, description="the KL reference model replays the same "
                                   "routing as the policy (a warning is logged when off)")
