"""model.moe_permute on one GPU (issue 55): megatron-core's moe_utils.permute / unpermute
against trainer.megatron.gather_permute at one MoE layer of Qwen3-30B-A3B (8,192 tokens, 128
experts top-8, hidden 2048, bf16, random routing and inputs drawn fresh per repeat): the largest
difference of each output and gradient, and the forward + backward time of each (CUDA events,
median of --repeats after warm-up; the routing's index work included).

Run: python tests/bench/probe_permute.py [--tokens 8192 --experts 128 --top-k 8 --hidden 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _step(ours: bool, x, probs, rm, k, w_rows, w_out):
    """One permute -> (rows, probs) -> unpermute, forward and backward; the tensors made."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from trainer.megatron.gather_permute import GatherPlan

    xi, pi = x.detach().requires_grad_(), probs.detach().requires_grad_()
    if ours:
        plan = GatherPlan(rm, k)
        rows, rows_p = plan.permute(xi, pi)
        out = plan.unpermute(rows * rows_p.unsqueeze(-1).to(rows.dtype))
    else:
        rows, rows_p, idx, _, _ = permute(xi, rm, probs=pi, num_out_tokens=rm.shape[0] * k)
        out = unpermute(rows * rows_p.unsqueeze(-1).to(rows.dtype), idx, restore_shape=x.shape)
    ((rows.float() * w_rows).sum() + (out.float() * w_out).sum()).backward()
    return rows, out, xi.grad, pi.grad


def _inputs(t, e, k, h, dev, gen):
    top = torch.rand(t, e, device=dev, generator=gen).topk(k, 1).indices
    rm = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter_(1, top, True)
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
    probs = torch.rand(t, e, device=dev, generator=gen).bfloat16()
    return x, probs, rm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    t, e, k, h = a.tokens, a.experts, a.top_k, a.hidden
    x, probs, rm = _inputs(t, e, k, h, dev, gen)
    w_rows = torch.randn(t * k, h, device=dev, generator=gen)
    w_out = torch.randn(t, h, device=dev, generator=gen)
    ref, got = (_step(o, x, probs, rm, k, w_rows, w_out) for o in (False, True))
    for name, u, v in zip(("rows", "unpermuted", "dx", "dprobs"), ref, got, strict=True):
        u, v = u.detach(), v.detach()
        scale = float(u.float().abs().max())
        print(f"{name:10s} max |ours - megatron| {float((u.float() - v.float()).abs().max()):.3e}"
              f" (max |megatron| {scale:.3e})")
    if dev.type != "cuda":
        return  # the differences only (times need CUDA events)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(a.repeats + 3):
        x, probs, rm = _inputs(t, e, k, h, dev, gen)
        for ours in (False, True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(ours, x, probs, rm, k, w_rows, w_out)
            end.record()
            torch.cuda.synchronize()
            if i >= 3:
                times[ours].append(start.elapsed_time(end))
    for ours in (False, True):
        print(f"{'gather' if ours else 'megatron':8s} permute + unpermute fwd+bwd "
              f"{statistics.median(times[ours]):.3f} ms (median of {a.repeats}; one layer, "
              f"T {t}, E {e}, K {k}, H {h}, bf16)")


if __name__ == "__main__":
    main()
