"""model.moe_permute: gather on CUDA in bf16 (issue 55): trainer.megatron.gather_permute against
megatron-core's moe_utils.permute / unpermute at Qwen3-30B-A3B's routing shape (128 experts
top-8; 4,096 tokens, hidden 256), random routing and inputs: rows, permuted probs and their
gradient exact (data movement); the unpermuted tokens and the tokens' gradient, sums of 8 bf16
rows, within megatron's 8 bf16 roundings (ours sum in fp32 and round once). CPU:
tests/unit/test_gather_permute.py; the time: tests/bench/probe_permute.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]


def _run(ours: bool, x, probs, rm, k, w_rows, w_p, w_out):
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from trainer.megatron.gather_permute import GatherPlan

    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    if ours:
        plan = GatherPlan(rm, k)
        rows, rows_p = plan.permute(xi, pi)
        out = plan.unpermute(rows)
    else:
        rows, rows_p, idx, _, _ = permute(xi, rm, probs=pi, num_out_tokens=rm.shape[0] * k)
        out = unpermute(rows, idx, restore_shape=x.shape)
    loss = ((rows.float() * w_rows).sum() + (rows_p.float() * w_p).sum()
            + (out.float() * w_out).sum())
    loss.backward()
    return [v.detach().float() for v in (rows, rows_p, out, xi.grad, pi.grad)]


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_permute_matches_megatron_on_cuda_bf16(seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    t, e, k, h = 4096, 128, 8, 256
    top = torch.rand(t, e, device=dev, generator=gen).topk(k, 1).indices
    rm = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, top, True)
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
    probs = torch.rand(t, e, device=dev, generator=gen).bfloat16()
    w = [torch.randn(s, device=dev, generator=gen) for s in ((t * k, h), (t * k,), (t, h))]
    ref, got = (_run(o, x, probs, rm, k, *w) for o in (False, True))
    for i, name in ((0, "rows"), (1, "probs"), (4, "dprobs")):
        assert torch.equal(ref[i], got[i]), name
    for i, name in ((2, "unpermuted"), (3, "dx")):
        assert torch.isfinite(got[i]).all(), name
        err = float((got[i] - ref[i]).abs().max())
        assert err <= k * 2 ** -8 * float(ref[i].abs().max()), (name, err)
