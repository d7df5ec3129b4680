"""GRPO advantages and the PPO-clip policy loss with optional k3 KL to a reference model.

All token-level tensors are [B, S] where position i holds the logprob of token i+1 (see
trainer.batch); `mask_BS` selects trained response tokens. `temperature_BS` is the sampling
temperature of the token each position predicts: rollouts sample from softmax(logits / T), so the
PPO ratio, the KL and the entropy are of that distribution (None = T 1 everywhere). Functions return SUMS over masked
tokens so micro-batches combine exactly into a per-token mean over the whole step.
Legend: B batch rows, S sequence, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.loss_config import LossConfig


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

    loss: torch.Tensor  # differentiable
    tokens: float
    ppo_kl: float
    kl_ref: float
    clipped: float
    entropy: float


def ppo_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor,
             adv_BS: torch.Tensor, old_lp_BS: torch.Tensor, ref_lp_BS: torch.Tensor | None,
             cfg: LossConfig, temperature_BS: torch.Tensor | None = None) -> LossSums:
    """PPO-clip on sampled-token logprobs (+ k3 KL to the reference, - entropy bonus), all
    under the sampling temperature."""
    lp = token_logprobs(logits_BSV, labels_BS, temperature_BS)
    ent = token_entropy(logits_BSV, temperature_BS)
    ratio = torch.exp(lp - old_lp_BS)
    pg1 = -adv_BS * ratio
    pg2 = -adv_BS * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_tok = torch.maximum(pg1, pg2) - cfg.entropy_coef * ent
    kl_ref = torch.zeros_like(lp)
    if ref_lp_BS is not None:
        d = ref_lp_BS - lp
        kl_ref = torch.exp(d) - d - 1  # k3: unbiased, always >= 0
        per_tok = per_tok + cfg.kl_coef * kl_ref
    m = mask_BS
    with torch.no_grad():
        stats = dict(ppo_kl=float(((old_lp_BS - lp) * m).sum()),
                     kl_ref=float((kl_ref * m).sum()),
                     clipped=float(((pg2 > pg1).float() * m).sum()),
                     entropy=float((ent * m).sum()))
    return LossSums(loss=(per_tok * m).sum(), tokens=float(m.sum()), **stats)


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
