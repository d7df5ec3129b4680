"""The fast path's log-softmax as two Triton kernels (loss.logprob_kernel: triton, issue 44).

trainer.losses.logprobs' chunked torch path makes ~15 passes over fp32 [chunk, V] tensors per chunk
(upcast, logsumexp, subtract, gather, exp, multiply, sum; in backward upcast, subtract, exp,
zeros, multiply, scatter, entropy, cast): at 8,192 rows x 151,936 that is ~75 ms of a 4-layer
step's 255 ms of GPU time on one H200 (profiled, docs/benchmarks/megatron-parallel.md). Here
one program per row streams the row's bf16 logits once in forward (online max / sum of exp /
sum of exp x shifted: logsumexp, the label's logprob and the entropy in one pass) and once in
backward (reads the row, writes its bf16 gradient), fp32 arithmetic throughout: the same
function as the torch path, another summation order (fp32 rounding apart; tests/gpu).
Rows are addressed through the [B, S, V] strides, so a non-contiguous logits view is not
copied. CUDA only (the caller picks it at start; CPU keeps the torch path).
Legend: N rows (B*S), V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per iteration of a row's loop


@triton.jit
def _fwd(x_ptr, stride_b, stride_s, S, V, labels_ptr, temp_ptr, lp_ptr, lse_ptr, ent_ptr,
         HAS_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + (row // S) * stride_b + (row % S) * stride_s
    inv_t = 1.0
    if HAS_T:
        inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    m = float("-inf")  # running max of x = logits / T
    s = 0.0  # sum of exp(x - m)
    t = 0.0  # sum of exp(x - m) * (x - m)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.exp(m - m_new)
        e = tl.where(ok, tl.exp(x - m_new), 0.0)
        # old terms re-centred on m_new: e' (x - m_new) = alpha e ((x - m) + (m - m_new))
        t = alpha * (t + tl.where(s > 0, (m - m_new) * s, 0.0)) \
            + tl.sum(tl.where(ok, e * (x - m_new), 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    label = tl.load(labels_ptr + row)
    x_label = tl.load(base + label).to(tl.float32) * inv_t
    tl.store(lp_ptr + row, x_label - lse)
    tl.store(lse_ptr + row, lse)
    tl.store(ent_ptr + row, log_s - t / s)  # H = lse - E[x] = log s - E[x - m]


@triton.jit
def _bwd(x_ptr, g_ptr, stride_b, stride_s, S, V, labels_ptr, temp_ptr, lse_ptr, ent_ptr,
         glp_ptr, gent_ptr, HAS_T: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offset = (row // S) * stride_b + (row % S) * stride_s
    inv_t = 1.0
    if HAS_T:
        inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    g_lp = 0.0
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + row)
    g_ent = 0.0
    ent = 0.0
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + row)
        ent = tl.load(ent_ptr + row)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + offset + cols, mask=ok, other=0.0).to(tl.float32) * inv_t
        logp = x - lse
        p = tl.exp(logp)
        g = tl.zeros([BLOCK], tl.float32)
        if HAS_GLP:  # d lp / dx = onehot(label) - p
            g = tl.where(cols == label, g_lp, 0.0) - p * g_lp
        if HAS_GENT:  # d H / dx = -p (logp + H)
            g -= g_ent * p * (logp + ent)
        tl.store(g_ptr + offset + cols, (g * inv_t).to(g_ptr.dtype.element_ty), mask=ok)


def _rows(logits_BSV: torch.Tensor) -> tuple[int, int, int, int]:
    b, s, v = logits_BSV.shape
    if logits_BSV.stride(2) != 1:
        raise ValueError("logits: the vocabulary dimension must be contiguous for the Triton "
                         "log-softmax")
    return b * s, s, logits_BSV.stride(0), logits_BSV.stride(1)


class LogprobEntropyTriton(torch.autograd.Function):
    """(logprob of the label, entropy), both [N] fp32, of [B, S, V] logits (any float dtype,
    vocabulary contiguous); the gradient has the logits' dtype and strides."""

    @staticmethod
    def forward(ctx: Any, logits_BSV: torch.Tensor, labels_N: torch.Tensor,
                temp_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        n, s, sb, ss = _rows(logits_BSV)
        lp_N = torch.empty(n, dtype=torch.float32, device=logits_BSV.device)
        lse_N, ent_N = torch.empty_like(lp_N), torch.empty_like(lp_N)
        labels_N = labels_N.contiguous()
        temp = None if temp_N is None else temp_N.float().contiguous()
        if n:
            _fwd[(n,)](logits_BSV, sb, ss, s, logits_BSV.shape[2], labels_N,
                       lp_N if temp is None else temp, lp_N, lse_N, ent_N,
                       HAS_T=temp is not None, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(logits_BSV, labels_N, lse_N, ent_N, temp)
        return lp_N, ent_N

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        logits_BSV, labels_N, lse_N, ent_N, temp = ctx.saved_tensors
        n, s, sb, ss = _rows(logits_BSV)
        grad = torch.empty_like(logits_BSV)  # same strides (dense): the kernel's offsets
        if grad.stride() != logits_BSV.stride():
            grad = torch.empty_strided(logits_BSV.shape, logits_BSV.stride(),
                                       dtype=logits_BSV.dtype, device=logits_BSV.device)
        glp = None if g_lp is None else g_lp.float().contiguous()
        gent = None if g_ent is None else g_ent.float().contiguous()
        if n:
            _bwd[(n,)](logits_BSV, grad, sb, ss, s, logits_BSV.shape[2], labels_N,
                       lse_N if temp is None else temp, lse_N, ent_N,
                       lse_N if glp is None else glp, lse_N if gent is None else gent,
                       HAS_T=temp is not None, HAS_GLP=glp is not None,
                       HAS_GENT=gent is not None, BLOCK=BLOCK, num_warps=8)
        return grad, None, None
