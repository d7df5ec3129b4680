"""trainer.losses.objectives / trainer.losses.loss choices on hand-computed examples, each checked against the
formula its paper or peer documents (cited per test)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from trainer.config import TrainerConfig
from trainer.hf.packing import pack_microbatch
from trainer.losses.corrections import shaped_rewards, staleness_metrics
from trainer.losses.loss import clipped_surrogate
from trainer.losses.loss_config import LossConfig, OverlongConfig, RolloutCorrectionConfig
from trainer.losses.objectives import (
    RolloutWeights,
    UpdateNorm,
    aggregate,
    all_equal,
    gspo_log_ratio,
    kl_estimate,
    overlong_penalty,
    rollout_weights,
    sequence_index,
    update_norm,
)
from trainer.samples.batch import Sample, make_microbatch


def _sample(prompt: int, resp: int, reward: float = 0.0, group: str = "g", version: int = 0
            ) -> Sample:
    return Sample(np.arange(prompt + resp, dtype=np.int64) % 5, prompt,
                  np.zeros(resp, np.float32), np.ones(resp, bool), reward, group,
                  policy_version=version)


@pytest.mark.parametrize(("cfg", "field"), [
    ({"agg_mode": "token-sum"}, "agg_mode"),
    ({"clip_ratio_c": 0.9}, "clip_ratio_c"),
    ({"kl_estimator": "k4"}, "kl_estimator"),
    ({"ratio_level": "group"}, "ratio_level"),
    ({"rollout_correction": {"is_threshold": 0.5}}, "rollout_correction.is_threshold"),
    ({"rollout_correction": {"mask_level": "batch"}}, "rollout_correction.mask_level"),
    ({"overlong": {"max_len": 8, "buffer": 9}}, "overlong"),
])
def test_bad_values_are_refused_naming_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        TrainerConfig.model_validate({"loss": cfg})
    assert f"loss.{field}" in str(e.value)


def test_rollout_correction_needs_the_trainer_old_policy() -> None:
    with pytest.raises(ValidationError, match="loss.rollout_correction.*old_logprobs"):
        TrainerConfig.model_validate({"loss": {"rollout_correction": {"is_level": "token"}},
                                      "data": {"old_logprobs": "rollout"}})
    TrainerConfig.model_validate({"loss": {"rollout_correction": {"is_level": "token"}}})


def test_dual_clip_bounds_a_negative_advantage() -> None:
    """Ye et al. 2020 eq. 5 / verl compute_policy_loss_vanilla: A < 0 -> min(max(-A r,
    -A clip(r)), -A c). A = -1, c = 3: r = 5 gives 3 (not 5) and no gradient; r = 2 gives 2."""
    log_r = torch.log(torch.tensor([5.0, 2.0, 5.0])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, clipped, dual = clipped_surrogate(torch.exp(log_r), adv, LossConfig(clip_ratio_c=3.0))
    assert loss.tolist() == pytest.approx([3.0, 2.0, -1.28])
    assert dual.tolist() == [True, False, False] and clipped.tolist() == [False, False, True]
    loss.sum().backward()
    assert log_r.grad is not None and log_r.grad.tolist() == pytest.approx([0.0, 2.0, 0.0])
    off, _, _ = clipped_surrogate(torch.tensor([5.0]), torch.tensor([-1.0]),
                                  LossConfig(clip_ratio_c=None))
    assert float(off) == pytest.approx(5.0)


def test_kl_estimators_and_their_clamp() -> None:
    """Schulman 2020 with d = log pi_ref - log pi = -0.3: k1 = 0.3, k2 = 0.045,
    k3 = e^-0.3 + 0.3 - 1; a huge d is clamped (verl kl_penalty) with a finite gradient."""
    lp, ref = torch.tensor([0.0]), torch.tensor([-0.3])
    assert float(kl_estimate(lp, ref, "k1", 10)) == pytest.approx(0.3)
    assert float(kl_estimate(lp, ref, "k2", 10)) == pytest.approx(0.045)
    assert float(kl_estimate(lp, ref, "k3", 10)) == pytest.approx(math.exp(-0.3) + 0.3 - 1)
    lp = torch.tensor([-200.0], requires_grad=True)
    kl = kl_estimate(lp, torch.tensor([0.0]), "k3", 10.0)
    kl.sum().backward()
    assert float(kl.detach()) == 10.0 and lp.grad is not None and torch.isfinite(lp.grad).all()


def test_sequence_index_padded_and_packed() -> None:
    a, b = _sample(2, 1), _sample(3, 2)
    padded = sequence_index(make_microbatch([a, b], pad_multiple=8))
    assert padded[0].tolist() == [2, 0, 2, 2, 2, 2, 2, 2]  # row 0: response predicted at pos 1
    assert padded[1].tolist() == [2, 2, 1, 1, 2, 2, 2, 2]
    packed = sequence_index(pack_microbatch([a, b], pad_multiple=8))
    assert packed[0].tolist() == [2, 0, 2, 2, 2, 1, 1, 2]


@pytest.mark.parametrize(("mode", "want"), [
    ("token-mean", 7 / 4),  # DAPO: every token weighs the same
    ("seq-mean-token-mean", (1 + 2) / 2),  # GRPO: mean per sequence, then over sequences
    ("seq-mean-token-sum", 7 / 2),
    ("seq-mean-token-sum-norm", 7 / (2 * 4)),  # Dr.GRPO: a constant per sequence (norm_len 4)
])
def test_aggregation_modes(mode: str, want: float) -> None:
    """verl agg_loss on sequences of 1 and 3 tokens with token losses [1] and [2, 2, 2]."""
    mb = make_microbatch([_sample(2, 1), _sample(2, 3)], pad_multiple=8)
    seq = sequence_index(mb)
    loss = torch.tensor([1.0, 2.0])[seq.clamp(max=1)] * mb.loss_mask_BS
    norm = update_norm([mb], dp_size=1)
    assert (norm.tokens, norm.seqs) == (4.0, 2.0)
    got = aggregate(loss, mb.loss_mask_BS, seq, 2, mode, norm, norm_len=4)  # type: ignore[arg-type]
    assert float(got) == pytest.approx(want)
    assert float(aggregate(loss, mb.loss_mask_BS, seq, 2, mode,  # type: ignore[arg-type]
                           UpdateNorm(norm.tokens, norm.seqs, 2), 4)) == pytest.approx(2 * want)


def test_truncated_and_masked_importance_weights() -> None:
    """verl rollout correction: w = pi_old / mu = [3, 0.5] on one sequence. TIS token:
    min(w, 2) = [2, 0.5]; sequence: prod = 1.5 on both. MIS token [0.5, 2]: the 3 is masked;
    sequence 1.5 and geometric sqrt(1.5) are kept; a [0.5, 1.2] window drops the sequence."""
    mask, seq = torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long)
    mu, old = torch.zeros(1, 2), torch.log(torch.tensor([[3.0, 0.5]]))

    def run(**kw) -> RolloutWeights:
        return rollout_weights(old, mu, mask, seq, 1, RolloutCorrectionConfig(**kw))
    tis = run(is_level="token")
    assert tis.is_weight_BS is not None and tis.truncated == 1
    assert tis.is_weight_BS[0].tolist() == pytest.approx([2.0, 0.5])
    seq_w = run(is_level="sequence").is_weight_BS
    assert seq_w is not None and seq_w[0].tolist() == pytest.approx([1.5, 1.5])
    mis = run(mask_level="token")
    assert mis.keep_BS.tolist() == [[0.0, 1.0]] and mis.masked == 1 and mis.is_weight_BS is None
    assert run(mask_level="sequence").keep_BS.tolist() == [[1.0, 1.0]]
    assert run(mask_level="geometric").keep_BS.tolist() == [[1.0, 1.0]]
    assert run(mask_level="sequence", mask_high=1.2).masked == 2
    both = run(is_level="token", mask_level="token")  # the 3 is both truncated and masked
    assert (both.truncated, both.masked) == (1, 1)


def test_gspo_sequence_ratio_value_and_gradient() -> None:
    """GSPO eq. 7 / 13: s_i = exp(mean_t log(pi / pi_old)); the token form's gradient is
    s_i * grad log pi_t. Log-ratios [0.1, 0.3] -> s = e^0.2 at both tokens."""
    lp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    lr = gspo_log_ratio(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 1)
    s = torch.exp(lr)
    assert s[0].tolist() == pytest.approx([math.exp(0.2)] * 2)
    s.sum().backward()
    assert lp.grad is not None and lp.grad[0].tolist() == pytest.approx([math.exp(0.2)] * 2)


def test_dapo_overlong_punishment_and_dynamic_sampling_test() -> None:
    """DAPO eq. 13 with L_max 10, L_cache 4: 0 up to 6, (6 - |y|) / 4 in (6, 10], -1 beyond."""
    cfg = OverlongConfig(max_len=10, buffer=4)
    assert [overlong_penalty(n, cfg) for n in (6, 8, 10, 11)] == [0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(50, OverlongConfig()) == 0.0
    assert all_equal([1.0, 1.0]) and not all_equal([1.0, 0.0]) and not all_equal([])
    loss = LossConfig(kl_coef=0.5, overlong={"max_len": 10, "buffer": 4})
    samples = [_sample(2, 8, reward=1.0), _sample(2, 3, reward=1.0)]
    assert shaped_rewards(samples, loss, kl_sums=[0.2, 0.4]) == pytest.approx([0.4, 0.8])


def test_staleness_histogram() -> None:
    samples = [_sample(2, 1, version=v) for v in (5, 5, 4, 2, 0)]
    m = staleness_metrics(samples, policy_version=5)
    assert m["staleness_hist"] == {"0": 2, "1": 1, "3": 1, "5": 1}
    assert m["staleness_max"] == 5.0 and m["staleness_mean"] == pytest.approx(1.8)
