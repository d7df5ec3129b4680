"""GRPO advantages, PPO-clip loss, k3 KL, entropy and the logprob-diff metric."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.losses.loss import (
    LossConfig,
    group_advantages,
    logprob_diff,
    ppo_loss,
    sft_loss,
    token_entropy,
    token_logprobs,
)


def test_group_advantages_are_normalised_per_group():
    adv = group_advantages([1.0, 0.0, 5.0, 5.0, 2.0], ["a", "a", "b", "b", "c"])
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2] == adv[3] == 0.0 and adv[4] == 0.0  # no spread, no signal
    centred = group_advantages([3.0, 1.0], ["a", "a"], std_normalize=False)
    assert centred.tolist() == [1.0, -1.0]


def _setup(b=2, s=5, v=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s)
    mask[0, 0] = 0
    return logits, labels, mask


def test_ppo_loss_on_policy_equals_minus_mean_advantage_and_has_no_clip():
    logits, labels, mask = _setup()
    adv = torch.full_like(mask, 0.5)
    old = token_logprobs(logits, labels).detach()
    out = ppo_loss(logits, labels, mask, adv, old, None, LossConfig())
    assert out.tokens == 9 and out.clipped == 0 and out.ppo_kl == pytest.approx(0, abs=1e-6)
    assert float(out.loss) / out.tokens == pytest.approx(-0.5)
    out.loss.backward()
    assert logits.grad is not None and logits.grad[0, 0].abs().sum() == 0  # masked position


def test_ppo_clip_counts_clipped_tokens_and_stops_their_gradient():
    logits, labels, mask = _setup()
    lp = token_logprobs(logits, labels).detach()
    old = lp - 1.0  # ratio e > 1 + clip_high everywhere
    out = ppo_loss(logits, labels, mask, torch.ones_like(mask), old, None, LossConfig())
    assert out.clipped == out.tokens
    out.loss.backward()
    assert logits.grad.abs().sum() == 0  # positive advantage, ratio above the clip: no gradient
    assert out.ppo_kl == pytest.approx(-1.0 * out.tokens, rel=1e-5)


def test_k3_kl_to_reference_is_zero_at_equality_and_positive_otherwise():
    logits, labels, mask = _setup()
    lp = token_logprobs(logits, labels).detach()
    cfg = LossConfig(kl_coef=0.1)
    same = ppo_loss(logits, labels, mask, torch.zeros_like(mask), lp, lp, cfg)
    assert same.kl_ref == pytest.approx(0.0, abs=1e-6)
    other = ppo_loss(logits, labels, mask, torch.zeros_like(mask), lp, lp - 0.3, cfg)
    assert other.kl_ref / other.tokens == pytest.approx(math.exp(-0.3) + 0.3 - 1, rel=1e-4)


def test_entropy_sft_and_logprob_diff():
    uniform = torch.zeros(1, 1, 8)
    assert float(token_entropy(uniform)) == pytest.approx(math.log(8))
    logits, labels, mask = _setup()
    loss, n = sft_loss(logits, labels, mask)
    assert n == 9 and float(loss) > 0
    a = torch.tensor([[0.0, -1.0, -2.0]])
    b = torch.tensor([[0.5, -1.0, -5.0]])
    mean, mx = logprob_diff(a, b, torch.tensor([[1.0, 1.0, 0.0]]))
    assert mean == pytest.approx(0.25) and mx == pytest.approx(0.5)
    assert logprob_diff(a, b, torch.zeros(1, 3)) == (0.0, 0.0)
    assert np.isfinite(mean)


def test_mismatch_sums_k3_and_far_tokens():
    from trainer.losses.loss import mismatch_sums

    rollout = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    train = torch.tensor([[0.5, -1.0, -5.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # the -3.0 token is masked out
    k3, far = mismatch_sums(rollout, train, mask)
    r = [0.5, 0.0, -1.5]
    assert k3 == pytest.approx(sum(math.exp(x) - 1 - x for x in r))
    assert far == 1.0  # only |-1.5| > 1
    assert mismatch_sums(rollout, rollout, mask) == (0.0, 0.0)
    assert mismatch_sums(rollout, train, torch.zeros(1, 4)) == (0.0, 0.0)


def test_logprobs_entropy_and_ppo_use_the_sampling_temperature():
    from trainer.losses.loss import ppo_loss, token_entropy, token_logprobs
    from trainer.losses.loss_config import LossConfig

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 5), generator=g)
    temp = torch.full((2, 5), 0.6)
    want = torch.log_softmax(logits / 0.6, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, labels, temp), want, atol=1e-6)
    assert not torch.allclose(token_logprobs(logits, labels), want, atol=1e-2)
    p = torch.softmax(logits / 0.6, -1)
    assert torch.allclose(token_entropy(logits, temp), -(p * p.log()).sum(-1), atol=1e-5)
    ones = torch.ones(2, 5)
    sums = ppo_loss(logits, labels, ones, ones, want, None, LossConfig(), temp)
    assert sums.ppo_kl == pytest.approx(0.0, abs=1e-5)  # on-policy at T: ratio 1


def test_diff_metrics_weights_two_micro_batches_by_their_tokens():
    from trainer.grpo import diff_metrics
    from trainer.samples.batch import MicroBatch

    def mb(rollout: list[float], mask: list[float]) -> MicroBatch:
        z = torch.zeros(1, len(mask))
        return MicroBatch(z.long(), z.long(), z.long(), torch.tensor([mask]),
                          torch.tensor([rollout]), z, None, z.bool())

    mbs = [mb([0.0, -2.0], [1.0, 1.0]), mb([-0.2, 0.0], [1.0, 0.0])]
    train = [torch.tensor([[0.0, -0.5]]), torch.tensor([[0.0, -9.0]])]
    m = diff_metrics(mbs, train, "_off")
    # |diff| over the 3 trained tokens: 0, 1.5, 0.2 (the masked -9 is not one of them)
    assert m["logprob_diff_mean_off"] == pytest.approx(1.7 / 3)
    assert m["logprob_diff_max_off"] == pytest.approx(1.5)
    r = [0.0, 1.5, 0.2]
    assert m["mismatch_kl_off"] == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 3)
    assert m["logprob_diff_far_share_off"] == pytest.approx(1 / 3)
    none = diff_metrics([mb([0.0], [0.0])], [torch.zeros(1, 1)], "")
    assert none == dict.fromkeys(["logprob_diff_mean", "logprob_diff_max", "mismatch_kl",
                                  "logprob_diff_far_share"])
