"""What the GRPO step (trainer.grpo) does with trainer.losses.objectives around its passes: reward
shaping before advantages (DAPO overlong, KL in reward), the rollout correction set on each
micro-batch after the old-policy pass (TIS weights, MIS mask), and the off-policy metrics of a
step (importance weights, rollout-vs-trainer mismatch KL, staleness in policy versions, and
|rollout - trainer| logprob per staleness).

Staleness of a sample = the trainer's policy version - the oldest version that sampled any of its
segments. A "fresh" sample was sampled by the very weights the trainer holds: its |Delta logprob|
is the engine/trainer mismatch alone (what R3 acts on); "stale" ones add the policy drift of the
versions in between.
Legend: B batch rows, S sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainer.losses.loss import group_advantages
from trainer.losses.loss_config import LossConfig, RolloutCorrectionConfig
from trainer.losses.objectives import (
    kl_estimate,
    overlong_penalty,
    per_token,
    rollout_weights,
    sequence_index,
)
from trainer.samples.batch import MicroBatch, Sample, response_logprobs


def shaped_rewards(samples: Sequence[Sample], cfg: LossConfig,
                   kl_sums: Sequence[float] | None = None) -> list[float]:
    """Rewards the advantages are computed from: + DAPO's soft overlong punishment,
    - kl_coef * the sequence's summed KL to the reference (kl_in reward)."""
    out = [s.reward + overlong_penalty(s.tokens.size - s.prompt_len, cfg.overlong)
           for s in samples]
    if kl_sums is not None:
        out = [r - cfg.kl_coef * k for r, k in zip(out, kl_sums, strict=True)]
    return out


def set_advantages(samples: Sequence[Sample], cfg: LossConfig,
                   kl_sums: Sequence[float] | None = None) -> None:
    """GRPO advantages of the shaped rewards on every sample; DAPO overlong filtering takes
    truncated samples out of the loss (their rewards still count in their group's baseline)."""
    adv = group_advantages(shaped_rewards(samples, cfg, kl_sums), [s.group_id for s in samples],
                           cfg.adv_eps, cfg.adv_std_normalize)
    for s, a in zip(samples, adv, strict=True):
        s.advantage = float(a)
        if cfg.overlong.filter and s.truncated:
            s.loss_mask = np.zeros_like(s.loss_mask)


def rewrite_advantages(mb: MicroBatch) -> None:
    """Refill `mb.advantages_BS` from its samples' `advantage` (after KL in reward)."""
    seq = sequence_index(mb)
    adv = torch.tensor([s.advantage for s in mb.samples] + [0.0],
                       device=mb.advantages_BS.device, dtype=mb.advantages_BS.dtype)
    mb.advantages_BS = per_token(adv, seq)


def kl_in_reward(mbs: Sequence[MicroBatch], cfg: LossConfig) -> None:
    """kl_in reward: each sample's summed KL(old policy || reference) over its trained tokens
    comes off its reward, advantages are recomputed per group and written back (verl
    apply_kl_penalty + GRPO's sum of token rewards)."""
    samples, sums = [], []
    for mb in mbs:
        assert mb.train_old_lp is not None and mb.ref_lp is not None
        kl = kl_estimate(mb.train_old_lp, mb.ref_lp, cfg.kl_estimator, cfg.kl_clamp)
        for s, k in zip(mb.samples, response_logprobs(mb, kl * mb.loss_mask_BS), strict=True):
            samples.append(s)
            sums.append(float(k.sum()))
    set_advantages(samples, cfg, sums)
    for mb in mbs:
        rewrite_advantages(mb)


def _metric_view(cfg: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
    """The correction measured on every step: the configured one, token level where off (so a
    run without correction still shows what TIS would truncate and MIS would mask)."""
    return cfg.model_copy(update={"is_level": cfg.is_level if cfg.is_level != "off" else "token",
                                  "mask_level": cfg.mask_level if cfg.mask_level != "off"
                                  else "token"})


def apply_rollout_correction(mbs: Sequence[MicroBatch], cfg: RolloutCorrectionConfig,
                             apply: bool) -> dict:
    """Importance weights pi_old / mu of every micro-batch (after the old-policy pass); with
    `apply` the TIS weight is set on the micro-batch and MIS's mask folded into its loss mask.
    Returns the step's IS metrics and the k1 estimate of the rollout-vs-trainer mismatch KL
    (its k3 estimate, `mismatch_kl`, is trainer.grpo.diff_metrics')."""
    view = _metric_view(cfg)
    tokens = w_sum = truncated = masked = kl1 = 0.0
    w_max = 0.0
    for mb in mbs:
        assert mb.train_old_lp is not None, "old-policy pass first"
        m, seq = mb.loss_mask_BS, sequence_index(mb)
        rw = rollout_weights(mb.train_old_lp, mb.old_logprobs_BS, m, seq, len(mb.samples), view)
        d = (mb.train_old_lp - mb.old_logprobs_BS) * m  # log pi_old - log mu
        tokens += float(m.sum())
        w_sum += float((rw.raw_BS * m).sum())
        w_max = max(w_max, float((rw.raw_BS * m).max())) if m.any() else w_max
        truncated, masked = truncated + rw.truncated, masked + rw.masked
        kl1 += float((-d).sum())  # k1 of KL(mu || pi_old), from mu
        if apply:
            mb.is_weight_BS = rw.is_weight_BS if cfg.is_level != "off" else None
            if cfg.mask_level != "off":
                mb.loss_mask_BS = m * rw.keep_BS
    if not tokens:
        return {}
    return {"is_weight_mean": w_sum / tokens, "is_weight_max": w_max,
            "is_truncated_share": truncated / tokens, "is_masked_share": masked / tokens,
            "mismatch_kl_k1": kl1 / tokens}


def staleness(samples: Sequence[Sample], policy_version: int) -> list[int]:
    """Versions behind the trainer of each sample (never negative)."""
    return [max(policy_version - s.policy_version, 0) for s in samples]


def staleness_metrics(samples: Sequence[Sample], policy_version: int) -> dict:
    """Per-step staleness: mean, max and the histogram (samples per versions behind; the
    loop sums `*_hist` over ranks)."""
    behind = staleness(samples, policy_version)
    if not behind:
        return {}
    hist = {str(v): behind.count(v) for v in sorted(set(behind))}
    return {"staleness_mean": float(np.mean(behind)), "staleness_max": float(max(behind)),
            "staleness_hist": hist}


def diff_by_staleness(mbs: Sequence[MicroBatch], lps: Sequence[torch.Tensor],
                      policy_version: int, suffix: str) -> dict:
    """Token-weighted mean |rollout - trainer| logprob of fresh samples (sampled by the version
    the trainer holds) and of stale ones (older), over trained tokens; a class with no token
    has no value."""
    sums = {"fresh": [0.0, 0.0], "stale": [0.0, 0.0]}
    for mb, lp in zip(mbs, lps, strict=True):
        diffs = response_logprobs(mb, (mb.old_logprobs_BS - lp).abs())
        for s, d in zip(mb.samples, diffs, strict=True):
            key = "fresh" if s.policy_version >= policy_version else "stale"
            sums[key][0] += float(d[s.loss_mask].sum())
            sums[key][1] += float(s.loss_mask.sum())
    return {f"logprob_diff_mean{suffix}_{k}": (v[0] / v[1] if v[1] else None)
            for k, v in sums.items()}
