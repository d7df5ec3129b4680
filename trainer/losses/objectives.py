"""The objective choices RL users bring from verl, slime and SkyRL, written once for both trainer
backends (they all go through trainer.grpo's loss function):

* rollout correction against the behaviour (rollout) policy mu: truncated importance sampling
  (TIS, Yao et al. 2025 "Your efficient RL framework secretly brings you off-policy RL
  training") and masked importance sampling (MIS, Liu et al. 2025 "When speed kills stability"),
  at token or sequence level, as verl's rollout correction (`rollout_is` / `rollout_rs`);
* loss aggregation as a GLOBAL normaliser over every data-parallel rank (verl `agg_loss`:
  token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm = Dr.GRPO's
  constant normaliser, Liu et al. 2025 arXiv 2503.20783);
* the KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL divergence"), clamped as verl's
  `kl_penalty`;
* GSPO's sequence-level ratio (Zheng et al. 2025 arXiv 2507.18071, eq. 7 and its token form
  GSPO-token, eq. 13);
* DAPO's reward shaping (Yu et al. 2025 arXiv 2503.14476): overlong filtering and the soft
  overlong punishment (eq. 13); dynamic sampling's "all rewards equal" group test (eq. 11).

Everything here is pure tensor maths on one micro-batch, plus one collective (`sum_over_ranks`).
Legend: B batch rows, S sequence, N sequences of a micro-batch (+1 bucket for non-response).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.losses.loss_config import AggMode, KlEstimator, OverlongConfig, RolloutCorrectionConfig

LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios to +-20 before exp: exp(20) is finite in fp32


# ---------------------------------------------------------------------- KL estimators
def kl_estimate(lp: torch.Tensor, ref_lp: torch.Tensor, estimator: KlEstimator,
                clamp: float) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with d = log pi_ref - log pi:
    k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (Schulman 2020); d clamped to +-20 first (so
    exp never overflows) and the estimate to +-clamp (verl `kl_penalty`)."""
    d = (ref_lp - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    else:
        kl = torch.exp(d) - d - 1
    return kl.clamp(-clamp, clamp)


# ---------------------------------------------------------------------- sequences of a micro-batch
def sequence_index(mb) -> torch.Tensor:
    """[B, S] long: index (in `mb.samples`) of the sample whose response token each position
    predicts; N = len(mb.samples) elsewhere (prompt, padding, filler). Padded micro-batches hold
    one sample per row, packed ones ([1, T], trainer.hf.packing) several back to back."""
    b, s = mb.tokens_BS.shape
    n = len(mb.samples)
    out = torch.full((b, s), n, dtype=torch.long)
    packed = b == 1 and n > 1
    off = 0
    for i, x in enumerate(mb.samples):
        row, start = (0, off) if packed else (i, 0)
        p, size = x.prompt_len, x.tokens.size
        out[row, start + p - 1:start + size - 1] = i
        off += size
    return out.to(mb.tokens_BS.device)


def per_sequence_sum(x_BS: torch.Tensor, seq_BS: torch.Tensor, n: int) -> torch.Tensor:
    """[N + 1] sums of `x_BS` per sequence (the last bucket: positions of no sequence)."""
    out = torch.zeros(n + 1, dtype=x_BS.dtype, device=x_BS.device)
    return out.index_add(0, seq_BS.reshape(-1), x_BS.reshape(-1))


def per_token(seq_values: torch.Tensor, seq_BS: torch.Tensor) -> torch.Tensor:
    """Broadcast [N + 1] per-sequence values back to [B, S]."""
    return seq_values[seq_BS]


# ---------------------------------------------------------------------- aggregation
@dataclass(frozen=True)
class UpdateNorm:
    """Global counts of one optimizer update, over every data-parallel rank."""

    tokens: float  # trained (masked-in) tokens
    seqs: float  # sequences with at least one trained token
    dp_size: int  # the backends' gradient reduction averages over this many replicas

    def denominator(self, mode: AggMode, norm_len: int) -> float:
        """What the update's summed (weighted) token losses are divided by (verl agg_loss)."""
        if mode == "token-mean":
            d = self.tokens
        elif mode == "seq-mean-token-sum-norm":
            d = self.seqs * norm_len
        else:
            d = self.seqs
        return max(d, 1.0)


def token_weights(mask_BS: torch.Tensor, seq_BS: torch.Tensor, n: int,
                  mode: AggMode) -> torch.Tensor:
    """Per-token weight of the aggregation: the mask, divided by its sequence's trained-token
    count in seq-mean-token-mean (each sequence then weighs the same)."""
    if mode != "seq-mean-token-mean":
        return mask_BS
    counts = per_sequence_sum(mask_BS, seq_BS, n).clamp(min=1.0)
    return mask_BS / per_token(counts, seq_BS)


def aggregate(loss_BS: torch.Tensor, mask_BS: torch.Tensor, seq_BS: torch.Tensor, n: int,
              mode: AggMode, norm: UpdateNorm, norm_len: int) -> torch.Tensor:
    """This micro-batch's share of the update's loss. Every rank divides by the GLOBAL count
    and multiplies by the data-parallel size, which undoes the average the backends' gradient
    reduction takes (megatron DDP, FSDP2): the summed gradient is that of one global mean."""
    w = token_weights(mask_BS, seq_BS, n, mode)
    return (loss_BS * w).sum() * (norm.dp_size / norm.denominator(mode, norm_len))


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise sums of `values` over every trainer rank (an all-reduce of the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64,
                     device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def update_norm(mbs: Sequence, dp_size: int) -> UpdateNorm:
    """Global counts of an update over `mbs`: every rank's are summed and divided by the ranks
    that hold copies of the same samples (world / dp: tensor- and pipeline-parallel peers)."""
    tokens = sum(float(mb.loss_mask_BS.sum()) for mb in mbs)
    seqs = 0.0
    for mb in mbs:
        seq, n = sequence_index(mb), len(mb.samples)
        seqs += float((per_sequence_sum(mb.loss_mask_BS, seq, n)[:n] > 0).sum())
    world = dist.get_world_size() if dist.is_initialized() else 1
    copies = max(world // max(dp_size, 1), 1)
    g_tokens, g_seqs = sum_over_ranks([tokens, seqs])
    return UpdateNorm(g_tokens / copies, g_seqs / copies, dp_size)


# ---------------------------------------------------------------------- ratios
def gspo_log_ratio(lp: torch.Tensor, old_lp: torch.Tensor, mask_BS: torch.Tensor,
                   seq_BS: torch.Tensor, n: int) -> torch.Tensor:
    """GSPO-token's per-token log ratio: sg[log s_i] + log pi - sg[log pi], where
    log s_i = (1/|y_i|) sum_t log(pi / pi_old) (GSPO eq. 7 and 13). Its value is the sequence's
    length-normalised ratio at every token; its gradient is s_i * grad log pi per token."""
    d = (lp - old_lp) * mask_BS
    counts = per_sequence_sum(mask_BS, seq_BS, n).clamp(min=1.0)
    seq_lr = per_token(per_sequence_sum(d, seq_BS, n) / counts, seq_BS)
    return seq_lr.detach() + lp - lp.detach()


@dataclass
class RolloutWeights:
    """Rollout correction of one micro-batch (no grad)."""

    is_weight_BS: torch.Tensor | None  # TIS weight per token (None: off)
    keep_BS: torch.Tensor  # 1 where MIS keeps the token
    raw_BS: torch.Tensor  # the untruncated per-token ratio pi_old / mu (metrics)
    truncated: float  # trained tokens whose TIS weight was cut at the threshold (MIS
                      # masked or not: the metric must not depend on MIS)
    masked: float  # trained tokens MIS left out


def _level_log_ratio(log_w: torch.Tensor, mask_BS: torch.Tensor, seq_BS: torch.Tensor, n: int,
                     level: str) -> torch.Tensor:
    if level == "token":
        return log_w
    sums = per_sequence_sum(log_w * mask_BS, seq_BS, n)
    if level == "geometric":
        sums = sums / per_sequence_sum(mask_BS, seq_BS, n).clamp(min=1.0)
    return per_token(sums, seq_BS)


@torch.no_grad()
def rollout_weights(old_lp: torch.Tensor, rollout_lp: torch.Tensor, mask_BS: torch.Tensor,
                    seq_BS: torch.Tensor, n: int, cfg: RolloutCorrectionConfig) -> RolloutWeights:
    """TIS weights min(w, C) and the MIS keep-mask of verl's rollout correction, with
    w = pi_old / mu per token, prod_t w_t per sequence, or its geometric mean."""
    log_w = (old_lp - rollout_lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask_BS
    keep = torch.ones_like(mask_BS)
    if cfg.mask_level != "off":
        lw = _level_log_ratio(log_w, mask_BS, seq_BS, n, cfg.mask_level)
        lo, hi = torch.log(torch.tensor(cfg.mask_low)), torch.log(torch.tensor(cfg.mask_high))
        keep = ((lw >= lo) & (lw <= hi)).to(mask_BS.dtype)
    weight, truncated = None, 0.0
    if cfg.is_level != "off":
        w = torch.exp(_level_log_ratio(log_w, mask_BS, seq_BS, n, cfg.is_level).clamp(
            max=LOG_RATIO_CLAMP))
        truncated = float(((w > cfg.is_threshold).to(mask_BS.dtype) * mask_BS).sum())
        weight = w.clamp(max=cfg.is_threshold)
    return RolloutWeights(weight, keep, torch.exp(log_w), truncated,
                          float(((1 - keep) * mask_BS).sum()))


# ---------------------------------------------------------------------- DAPO reward shaping
def overlong_penalty(response_len: int, cfg: OverlongConfig) -> float:
    """DAPO's soft overlong punishment (eq. 13): 0 up to L_max - L_cache, then a linear ramp
    ((L_max - L_cache) - |y|) / L_cache down to -1 at L_max, -1 beyond; times `penalty`."""
    if not cfg.max_len:
        return 0.0
    start = cfg.max_len - cfg.buffer
    if response_len <= start:
        return 0.0
    if response_len > cfg.max_len:
        return -cfg.penalty
    return cfg.penalty * (start - response_len) / cfg.buffer


def all_equal(rewards: Sequence[float], tol: float = 0.0) -> bool:
    """DAPO dynamic sampling's test: a group whose rewards are all equal has zero advantage
    everywhere (no policy gradient) and is dropped (eq. 11: 0 < |correct| < G)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) <= tol
