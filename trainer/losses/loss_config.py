"""`LossConfig`: the PPO/GRPO objective's knobs (the config of trainer.losses.loss, kept apart so
trainer.config imports no runtime module), and those of trainer.losses.objectives' choices."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from services.common.config import StrictConfig

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
KlEstimator = Literal["k1", "k2", "k3"]


class RolloutCorrectionConfig(StrictConfig):
    """Importance weights pi_old / mu of the trainer's old-policy pass against the rollout
    engine's sampled-token logprobs (needs data.old_logprobs = trainer)."""

    is_level: Literal["off", "token", "sequence"] = Field(
        "off", description="truncated importance sampling (TIS): every token's policy loss is "
        "weighted by min(w, is_threshold), w the token's ratio (token) or the product of its "
        "sequence's ratios (sequence); off = no weight")
    is_threshold: float = Field(2.0, gt=1, description="TIS truncation C of min(w, C)")
    mask_level: Literal["off", "token", "sequence", "geometric"] = Field(
        "off", description="masked importance sampling (MIS): tokens (token), or whole "
        "sequences (sequence: product of ratios; geometric: their geometric mean), whose ratio "
        "is outside [mask_low, mask_high] are left out of the loss and of its normaliser")
    mask_low: float = Field(0.5, gt=0, lt=1, description="MIS lower bound")
    mask_high: float = Field(2.0, gt=1, description="MIS upper bound")

    @property
    def enabled(self) -> bool:
        return self.is_level != "off" or self.mask_level != "off"


class OverlongConfig(StrictConfig):
    """DAPO's treatment of responses that hit the length limit."""

    filter: bool = Field(False, description="overlong filtering: truncated responses "
                         "(finish reason length) are left out of the loss")
    max_len: int = Field(0, ge=0, description="L_max, response tokens, for the soft overlong "
                         "punishment (0 = off)")
    buffer: int = Field(0, ge=0, description="L_cache: the punishment ramps from 0 at "
                        "L_max - L_cache to -penalty at L_max")
    penalty: float = Field(1.0, ge=0, description="scale of the soft overlong punishment")

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongConfig:
        if self.max_len and not 0 < self.buffer <= self.max_len:
            raise ValueError(f"buffer: {self.buffer} must be in (0, max_len={self.max_len}] when "
                             "max_len is set")
        return self


class LossConfig(StrictConfig):
    """PPO/GRPO objective knobs (trainer.losses.objectives has the maths and its references)."""

    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 - clip_low")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 + clip_high")
    clip_ratio_c: float | None = Field(
        3.0, gt=1, description="dual-clip (Ye et al. 2020; verl clip_ratio_c): with a negative "
        "advantage a token's loss is at most -A * clip_ratio_c however large its ratio; "
        "null = off")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="token: the PPO ratio per token; sequence: GSPO's length-normalised "
        "sequence ratio (use small clips, e.g. 3e-4 / 4e-4, and seq-mean-token-mean)")
    agg_mode: AggMode = Field(
        "token-mean", description="loss normaliser over the whole update on every data-parallel "
        "rank: token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum, "
        "seq-mean-token-sum-norm (Dr.GRPO: divided by agg_norm_len per sequence)")
    agg_norm_len: int = Field(1024, ge=1, description="Dr.GRPO's constant normaliser (the "
                              "generation budget, response tokens) of seq-mean-token-sum-norm")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL to the reference model "
                           "(0 and kl_metric off = no reference model is built)")
    kl_estimator: KlEstimator = Field("k3", description="k1 | k2 | k3 (Schulman 2020)")
    kl_clamp: float = Field(10.0, gt=0, description="each token's KL estimate clamped to "
                            "+-kl_clamp (verl)")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="loss: kl_coef * KL per token in the loss; reward: kl_coef * the "
        "sequence's summed KL of the old policy subtracted from its reward before advantages "
        "(verl use_kl_in_reward)")
    kl_metric: bool = Field(False, description="build the reference model and report kl_ref "
                            "even when kl_coef is 0 (a measurement: no gradient)")
    kl_metric_every: int = Field(
        1, ge=1, description="with kl_metric at kl_coef 0: the reference pass (kl_ref) on the "
        "step to every N-th policy version only (step 1 of a fresh run included; 1 = every "
        "step); the other steps log kl_ref None. kl_coef > 0 needs it every step")
    entropy_coef: float = Field(0.0, description="entropy bonus weight (subtracted from loss)")
    chunked_logprobs: bool | Literal["auto"] = Field(
        "auto", description="ppo_loss takes logprobs and entropy from trainer.losses.logprobs' chunked "
        "log-softmax (no fp32 copy of the full-vocabulary logits; the entropy without a graph "
        "when entropy_coef is 0) instead of torch.log_softmax (the reference; issue 30); auto = "
        "on for bf16 logits on a CUDA device (the trainer decides it at start: "
        "TrainerConfig.fast_path), the reference otherwise")
    logprob_kernel: Literal["auto", "torch", "triton"] = Field(
        "auto", description="what computes the chunked log-softmax (with chunked_logprobs on): "
        "triton = one Triton kernel per direction that streams each row of logits once "
        "(trainer.losses.logprobs_triton; CUDA only), which also gives the old-policy and reference "
        "passes their logprobs; torch = the chunked torch loop; auto = triton where the logits "
        "are on a CUDA device and Triton imports, torch otherwise (issue 44)")
    adv_eps: float = Field(1e-6, gt=0, description="std floor of group-normalised advantages")
    adv_std_normalize: bool = Field(True, description="divide by the group reward std (GRPO)")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,  # type: ignore[arg-type]
        description="TIS / MIS against the rollout policy (needs data.old_logprobs trainer)")
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig,  # type: ignore[arg-type]
        description="DAPO overlong filtering and soft overlong punishment")

    def chunked_for(self, logits: Any) -> bool:
        """Whether ppo_loss runs the chunked log-softmax on `logits` (auto: bf16 on CUDA)."""
        if self.chunked_logprobs == "auto":
            return bool(logits.is_cuda and str(logits.dtype) == "torch.bfloat16")
        return self.chunked_logprobs

    def triton_for(self, logits: Any) -> bool:
        """Whether the chunked log-softmax on `logits` runs the Triton kernels."""
        from trainer.losses.logprobs import triton_runs

        return self.chunked_for(logits) and triton_runs(logits, self.logprob_kernel)

    def reference_due(self, policy_version: int) -> bool:
        """Whether the step from `policy_version` runs the reference pass."""
        return self.kl_coef > 0 or (self.kl_metric and policy_version % self.kl_metric_every == 0)

    @property
    def uses_reference(self) -> bool:
        """Whether a reference model is built and its logprobs computed."""
        return self.kl_coef > 0 or self.kl_metric
