"""`LossConfig`: the PPO/GRPO objective's knobs (the config of trainer.loss, kept apart so
trainer.config imports no runtime module)."""

from __future__ import annotations

from pydantic import Field

from services.common.config import StrictConfig


class LossConfig(StrictConfig):
    """PPO/GRPO objective knobs."""

    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 + clip_high")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference model "
                           "(0 = no reference model is built)")
    entropy_coef: float = Field(0.0, description="entropy bonus weight (subtracted from loss)")
    adv_eps: float = Field(1e-6, gt=0, description="std floor of group-normalised advantages")
    adv_std_normalize: bool = Field(True, description="divide by the group reward std (GRPO)")
