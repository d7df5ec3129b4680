"""The fast path's two kernels on one GPU, before the bench uses them (issue 30): correctness
against an fp32 reference (fresh random inputs, ||out - ref|| / ||ref||) and median times.

  * GroupedExperts (torch._grouped_mm, bf16) vs its loop over the same stacked weights, forward
    and backward, at one EP4 rank's share of Qwen3-30B-A3B (32 local experts, 4096 x 8 routed
    tokens, uneven counts, some experts empty);
  * SdpaAttention (F.scaled_dot_product_attention, causal, GQA 32/4 without K/V repeat) vs
    megatron-style unfused attention in fp32, seq 4096, head dim 128.
Run: python tests/bench/probe_fastpath.py (CUDA only).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def experts(tokens: int = 32768, el: int = 32, h: int = 2048, f: int = 768) -> None:
    from trainer.megatron.grouped_experts import GroupedExperts

    cfg = SimpleNamespace(add_bias_linear=False, expert_tensor_parallel_size=1,
                          moe_apply_probs_on_input=False, bias_activation_fusion=False,
                          hidden_size=h, moe_ffn_hidden_size=f, gated_linear_unit=True,
                          expert_model_parallel_size=4, tensor_model_parallel_size=1,
                          params_dtype=torch.bfloat16, perform_initialization=True,
                          init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
                          output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
                          activation_func=F.silu, activation_func_clamp_value=None,
                          glu_linear_offset=0.0)
    mod = GroupedExperts(el, cfg).cuda()
    counts = torch.distributions.Dirichlet(torch.ones(el)).sample() * tokens
    counts = counts.long()
    counts[:3] = 0  # empty experts
    counts[-1] += tokens - counts.sum()
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda")
    out, _ = mod(x, counts, probs)
    out.backward(torch.ones_like(out))
    grads = (x.grad.clone(), mod.linear_fc1.weight.grad.clone())
    x.grad, mod.linear_fc1.weight.grad = None, None
    ref_mod = GroupedExperts(el, cfg).cuda().float()  # the loop, fp32: the reference
    ref_mod.load_state_dict({k: v.float() for k, v in mod.state_dict().items()})
    xf = x.detach().float().requires_grad_(True)
    ref, _ = ref_mod(xf, counts, probs)
    ref.backward(torch.ones_like(ref))
    print(f"grouped experts: out rel {_rel(out, ref):.2e}, dx rel {_rel(grads[0], xf.grad):.2e}, "
          f"dW1 rel {_rel(grads[1], ref_mod.linear_fc1.weight.grad):.2e}")
    loop = GroupedExperts(el, cfg).cuda()
    loop.load_state_dict(mod.state_dict())

    def step(m, grouped: bool):
        def run():
            if grouped:
                o, _ = m(x, counts, probs)
            else:  # the loop path in bf16 (what SequentialMLP costs, minus its module calls)
                o = torch.cat([F.linear(m._scaled(F.linear(t, m.linear_fc1.weight[e]), p),
                                        m.linear_fc2.weight[e]) for e, (t, p) in enumerate(zip(
                    torch.split(x, counts.tolist()), torch.split(probs, counts.tolist()),
                    strict=True))])
            o.backward(torch.ones_like(o))
        return run
    tg, tl = _time(step(mod, True)), _time(step(loop, False))
    flops = 3 * 2 * tokens * h * 3 * f
    print(f"grouped experts fwd+bwd: grouped {tg:.2f} ms ({flops / tg / 1e9:.0f} TFLOP/s), "
          f"loop {tl:.2f} ms ({flops / tl / 1e9:.0f} TFLOP/s)")


def attention(s: int = 4096, nh: int = 32, ng: int = 4, d: int = 128) -> None:
    from trainer.megatron.fused_attention import SdpaAttention

    q = torch.randn(s, 1, nh, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(s, 1, ng, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    cfg = SimpleNamespace(softmax_type="vanilla", window_size=None, multi_latent_attention=False,
                          apply_query_key_layer_scaling=False, context_parallel_size=1,
                          attention_dropout=0.0, kv_channels=d)
    from megatron.core.transformer.enums import AttnMaskType

    mod = SdpaAttention(cfg, 1, AttnMaskType.causal, "self")
    out = mod(q, k, v, None)
    qf, kf, vf = (t.detach().double().permute(1, 2, 0, 3) for t in (q, k, v))
    kf, vf = (t.repeat_interleave(nh // ng, 1) for t in (kf, vf))
    scores = (qf @ kf.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1),
                                float("-inf"))
    ref = (scores.softmax(-1) @ vf).permute(2, 0, 1, 3).reshape(s, 1, nh * d)
    print(f"sdpa: out rel {_rel(out, ref):.2e}")

    def run():
        o = mod(q, k, v, None)
        o.backward(torch.ones_like(o))
    t = _time(run)
    flops = 3 * 2 * 2 * nh * d * s * s / 2
    print(f"sdpa fwd+bwd causal GQA: {t:.2f} ms ({flops / t / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name(0))
    experts()
    attention()
