"""GRPO advantages and the PPO-clip policy loss (dual-clip, GSPO ratio, TIS weight) with an
optional KL to a reference model; the choices and their maths are trainer.losses.objectives'.

All token-level tensors are [B, S] where position i holds the logprob of token i+1 (see
trainer.samples.batch); `mask_BS` selects trained response tokens. `temperature_BS` is the sampling
temperature of the token each position predicts: rollouts sample from softmax(logits / T), so the
PPO ratio, the KL and the entropy are of that distribution (None = T 1 everywhere). `ppo_loss`
returns masked SUMS (metrics) and the per-token loss, which trainer.losses.objectives.aggregate divides
by the update's global normaliser.
Legend: B batch rows, S sequence, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.losses.logprobs import logprob_entropy
from trainer.losses.loss_config import LossConfig
from trainer.losses.objectives import LOG_RATIO_CLAMP, gspo_log_ratio, kl_estimate


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], eps: float = 1e-6,
                     std_normalize: bool = True) -> np.ndarray:
    """GRPO: (r - mean of its group) / (std of its group + eps)."""
    r = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(r)
    keys = np.asarray(group_ids)
    for g in set(group_ids):
        idx = np.flatnonzero(keys == g)
        centered = r[idx] - r[idx].mean()
        out[idx] = centered / (r[idx].std() + eps) if std_normalize else centered
    return out.astype(np.float32)


def _scaled(logits_BSV: torch.Tensor, temperature_BS: torch.Tensor | None) -> torch.Tensor:
    x = logits_BSV.float()
    if temperature_BS is None:
        return x
    return x / temperature_BS.to(x.device, torch.float32).unsqueeze(-1)


def token_logprobs(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                   temperature_BS: torch.Tensor | None = None) -> torch.Tensor:
    """log p(label) at every position under softmax(logits / T), fp32."""
    logp = torch.log_softmax(_scaled(logits_BSV, temperature_BS), dim=-1)
    return logp.gather(-1, labels_BS.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BSV: torch.Tensor, temperature_BS: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Entropy of the next-token distribution softmax(logits / T) at every position, fp32."""
    logp = torch.log_softmax(_scaled(logits_BSV, temperature_BS), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class LossSums:
    """Masked sums of one micro-batch (divide by `tokens` for means)."""

    loss: torch.Tensor  # differentiable: the masked token sum of loss_BS
    tokens: float
    ppo_kl: float
    kl_ref: float
    clipped: float
    entropy: float
    clipped_dual: float = 0.0  # negative-advantage tokens held at -A * clip_ratio_c
    loss_BS: torch.Tensor | None = None  # per-token loss (differentiable), for aggregation


def clipped_surrogate(ratio: torch.Tensor, adv_BS: torch.Tensor, cfg: LossConfig
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped, dual-clipped) of PPO-clip with dual-clip: max(-A r,
    -A clip(r)), and for A < 0 at most -A * c (Ye et al. 2020, eq. 5; verl
    compute_policy_loss_vanilla)."""
    pg1 = -adv_BS * ratio
    pg2 = -adv_BS * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if cfg.clip_ratio_c is not None:
        pg3 = -adv_BS * cfg.clip_ratio_c
        dual = (adv_BS < 0) & (loss > pg3)
        loss = torch.where(dual, pg3, loss)
    return loss, clipped, dual


def ppo_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor,
             adv_BS: torch.Tensor, old_lp_BS: torch.Tensor, ref_lp_BS: torch.Tensor | None,
             cfg: LossConfig, temperature_BS: torch.Tensor | None = None, *,
             seq_BS: torch.Tensor | None = None, n_seqs: int = 0,
             is_weight_BS: torch.Tensor | None = None) -> LossSums:
    """PPO-clip (dual-clip; GSPO's sequence ratio with `ratio_level` sequence, which needs
    `seq_BS`, trainer.losses.objectives.sequence_index) on sampled-token logprobs, times the TIS
    weight, + kl_coef * KL to the reference (kl_in loss), - entropy bonus, all under the
    sampling temperature."""
    lp, ent = logprob_entropy(logits_BSV, labels_BS, temperature_BS, cfg.entropy_coef != 0,
                              kernel="triton" if cfg.triton_for(logits_BSV) else "torch") \
        if cfg.chunked_for(logits_BSV) else (token_logprobs(logits_BSV, labels_BS, temperature_BS),
                                      token_entropy(logits_BSV, temperature_BS))
    log_ratio = lp - old_lp_BS
    if cfg.ratio_level == "sequence":
        assert seq_BS is not None, "GSPO needs the micro-batch's sequence index"
        log_ratio = gspo_log_ratio(lp, old_lp_BS, mask_BS, seq_BS, n_seqs)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    per_tok, clipped, dual = clipped_surrogate(ratio, adv_BS, cfg)
    if is_weight_BS is not None:
        per_tok = per_tok * is_weight_BS
    per_tok = per_tok - cfg.entropy_coef * ent
    kl_ref = torch.zeros_like(lp)
    if ref_lp_BS is not None:
        kl_ref = kl_estimate(lp, ref_lp_BS, cfg.kl_estimator, cfg.kl_clamp)
        if cfg.kl_in == "loss" and cfg.kl_coef > 0:
            per_tok = per_tok + cfg.kl_coef * kl_ref
    m = mask_BS
    with torch.no_grad():
        stats = dict(ppo_kl=float(((old_lp_BS - lp) * m).sum()),
                     kl_ref=float((kl_ref * m).sum()),
                     clipped=float((clipped.float() * m).sum()),
                     clipped_dual=float((dual.float() * m).sum()),
                     entropy=float((ent * m).sum()))
    return LossSums(loss=(per_tok * m).sum(), tokens=float(m.sum()), loss_BS=per_tok, **stats)


def sft_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor):
    """Cross-entropy sum over masked positions, and the token count."""
    lp = token_logprobs(logits_BSV, labels_BS)
    return -(lp * mask_BS).sum(), float(mask_BS.sum())


def logprob_diff(rollout_lp_BS: torch.Tensor, train_lp_BS: torch.Tensor,
                 mask_BS: torch.Tensor) -> tuple[float, float]:
    """Mean and max |rollout logprob - trainer logprob| over masked tokens."""
    sel = mask_BS.bool()
    if not sel.any():
        return 0.0, 0.0
    d = (rollout_lp_BS - train_lp_BS).abs()[sel]
    return float(d.mean()), float(d.max())


# |rollout - trainer| logprob above this is a token the two sides disagree on outright (a
# probability ratio past e): its share is the mismatch's tail, which the mean hides
LOGPROB_DIFF_FAR = 1.0


def mismatch_sums(rollout_lp_BS: torch.Tensor, train_lp_BS: torch.Tensor,
                  mask_BS: torch.Tensor) -> tuple[float, float]:
    """Over masked tokens: the summed k3 estimate of KL(rollout || trainer) from the rollout's
    samples (kl_estimate, unclamped), and the count of tokens with |rollout - trainer| >
    LOGPROB_DIFF_FAR (divide both by the token count)."""
    sel = mask_BS.bool()
    if not sel.any():
        return 0.0, 0.0
    rollout, train = rollout_lp_BS.double()[sel], train_lp_BS.double()[sel]
    k3 = kl_estimate(rollout, train, "k3", clamp=float("inf"))
    return float(k3.sum()), float(((rollout - train).abs() > LOGPROB_DIFF_FAR).sum())
