"""model.moe_permute: gather (trainer.megatron.gather_permute, issue 55) against megatron-core's
own moe_utils.permute / unpermute on random dropless top-k routings (fresh draws per case):
the same permuted rows, probs and token order bit for bit, the same unpermuted tokens and
gradients (the sums of a token's k rows to fp32 rounding; bf16: within megatron's k
roundings, ours summing in fp32 and rounding once); the switch's `auto` and its refusal.
The model-level check (EP2 ranks, r2 and r3 steps with MoE recompute) is
tests/integration/test_planned_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from trainer.megatron.config import ModelConfig


def _routing(t: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    top = torch.rand(t, e, generator=gen).topk(k, 1).indices
    return torch.zeros(t, e, dtype=torch.bool).scatter_(1, top, True)


def _both(x, probs, y, rm, k):
    """(megatron's, ours): permuted rows, permuted probs, unpermuted y, and the grads of x,
    probs and y under one random linear loss."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from trainer.megatron.gather_permute import GatherPlan

    gen = torch.Generator().manual_seed(7)
    out = []
    for ours in (False, True):
        xi, pi, yi = (v.clone().requires_grad_() for v in (x, probs, y))
        if ours:
            plan = GatherPlan(rm, k)
            rows, rows_p = plan.permute(xi, pi)
            back = plan.unpermute(yi)
            idx = plan.src_P
        else:
            rows, rows_p, idx, _, _ = permute(xi, rm, probs=pi, num_out_tokens=rm.shape[0] * k)
            back = unpermute(yi, idx, restore_shape=x.shape)
        if not out:
            w = [torch.randn(v.shape, generator=gen).to(v.dtype) for v in (rows, rows_p, back)]
        loss = sum((v.float() * wi.float()).sum() for v, wi in zip((rows, rows_p, back), w,
                                                                    strict=True))
        loss.backward()
        out.append((rows.detach(), rows_p.detach(), back.detach(), idx, xi.grad, pi.grad,
                    yi.grad))
    return out


@pytest.mark.parametrize("t,e,k", [(37, 8, 2), (64, 16, 4), (5, 8, 8)])
def test_gather_equals_megatron_in_fp32(t, e, k):
    gen = torch.Generator().manual_seed(t * 100 + e)
    rm = _routing(t, e, k, gen)
    x, y = torch.randn(t, 24, generator=gen), torch.randn(t * k, 24, generator=gen)
    probs = torch.rand(t, e, generator=gen)
    (a, b) = _both(x, probs, y, rm, k)
    names = ("rows", "probs", "unpermuted", "idx", "dx", "dprobs", "dy")
    for i in (0, 1, 3, 5, 6):  # data movement only: exact
        assert torch.equal(a[i], b[i]), names[i]
    for i in (2, 4):  # sums of k rows: fp32, in another order where torch's reduction blocks
        torch.testing.assert_close(b[i], a[i], rtol=1e-6, atol=1e-6, msg=names[i])


def test_gather_matches_megatron_in_bf16_and_with_empty_experts():
    gen = torch.Generator().manual_seed(3)
    t, e, k = 96, 32, 4
    rm = _routing(t, e // 2, k, gen)  # experts 16..31 receive nothing
    rm = torch.cat([rm, torch.zeros(t, e - e // 2, dtype=torch.bool)], 1)
    x = torch.randn(t, 64, generator=gen).bfloat16()
    y = torch.randn(t * k, 64, generator=gen).bfloat16()
    probs = torch.rand(t, e, generator=gen).bfloat16()
    (a, b) = _both(x, probs, y, rm, k)
    for i in (0, 1, 3, 6):  # data movement only: exact
        assert torch.equal(a[i], b[i]), i
    for i in (2, 4):  # sums of k bf16 rows: megatron rounds at each of its k adds
        ref = a[i].float()
        assert (b[i].float() - ref).abs().max() <= k * 2 ** -8 * ref.abs().max(), i


def test_moe_permute_auto_and_refusal():
    assert ModelConfig().moe_permute == "megatron"  # off until measured on a GPU
    fast = ModelConfig(dtype="bf16", moe_permute="auto")
    assert fast.fast_path(cuda=True).moe_permute == "gather"
    assert fast.fast_path(cuda=False).moe_permute == "megatron"
    assert ModelConfig(dtype="bf16", moe_permute="auto", planned_dispatch=False).fast_path(
        cuda=True).moe_permute == "megatron"
    with pytest.raises(ValueError, match="moe_permute: gather needs model.planned_dispatch"):
        ModelConfig(moe_permute="gather", planned_dispatch=False)
    assert ModelConfig().batch_first_logits == "auto"  # measured: on where the fast path runs
