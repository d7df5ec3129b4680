"""Chunked log-softmax: each label's logprob and the entropy of [N, V] logits without an fp32
copy of the whole vocabulary (issue 30's fast path; trainer.losses.loss keeps the plain reference).

`logprob_entropy(logits, labels, temperature)` upcasts `chunk` rows at a time, keeps one fp32
logsumexp per row for backward and recomputes the chunk's softmax there, so its extra memory is
O(chunk x V) instead of the several [N, V] fp32 tensors `torch.log_softmax(logits.float())`
and its entropy keep for autograd. The entropy is computed under no_grad (a metric, no graph)
unless `entropy_grad` asks for its gradient (an entropy bonus). Same arithmetic as the plain
path in fp32 (logits / T, logsumexp, gather), another summation order: equal to fp32 rounding.
Legend: N rows (B*S), V vocabulary.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

CHUNK = 1024  # rows per fp32 upcast: 1024 x 151,936 x 4 B = 0.6 GiB


def _scaled(x: torch.Tensor, temp_N: torch.Tensor | None) -> torch.Tensor:
    x = x.float()
    return x if temp_N is None else x / temp_N.float().unsqueeze(-1)


def _chunk_stats(x_CV: torch.Tensor, labels_C: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of the label, logsumexp, entropy) of one fp32 chunk."""
    lse_C = torch.logsumexp(x_CV, -1)
    logp_CV = x_CV - lse_C.unsqueeze(-1)
    lp_C = logp_CV.gather(-1, labels_C.unsqueeze(-1)).squeeze(-1)
    ent_C = -(logp_CV.exp() * logp_CV).sum(-1)  # as trainer.losses.loss.token_entropy sums it
    return lp_C, lse_C, ent_C


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_NV: torch.Tensor, labels_N: torch.Tensor,
                temp_N: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits_NV.shape[0]
        lp_N = logits_NV.new_empty(n, dtype=torch.float32)
        lse_N, ent_N = torch.empty_like(lp_N), torch.empty_like(lp_N)
        for a in range(0, n, chunk):
            t = None if temp_N is None else temp_N[a:a + chunk]
            lp_N[a:a + chunk], lse_N[a:a + chunk], ent_N[a:a + chunk] = _chunk_stats(
                _scaled(logits_NV[a:a + chunk], t), labels_N[a:a + chunk])
        ctx.save_for_backward(logits_NV, labels_N, lse_N, temp_N)
        ctx.chunk = chunk
        return lp_N, ent_N

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        logits_NV, labels_N, lse_N, temp_N = ctx.saved_tensors
        grad = torch.empty_like(logits_NV)
        for a in range(0, logits_NV.shape[0], ctx.chunk):
            sl = slice(a, a + ctx.chunk)
            t = None if temp_N is None else temp_N[sl]
            logp = _scaled(logits_NV[sl], t) - lse_N[sl].unsqueeze(-1)
            p = logp.exp()
            g = torch.zeros_like(logp)
            if g_lp is not None:  # d lp / dx = onehot(label) - p
                g -= p * g_lp[sl].unsqueeze(-1)
                g.scatter_add_(-1, labels_N[sl].unsqueeze(-1), g_lp[sl].unsqueeze(-1))
            if g_ent is not None:  # d H / dx = -p * (logp + H)
                ent = -(p * logp).sum(-1, keepdim=True)
                g -= g_ent[sl].unsqueeze(-1) * p * (logp + ent)
            if t is not None:
                g = g / t.float().unsqueeze(-1)
            grad[sl] = g.to(grad.dtype)
        return grad, None, None, None


def triton_runs(logits: torch.Tensor, kernel: str = "auto") -> bool:
    """Whether `kernel` (loss.logprob_kernel: auto | torch | triton) runs the Triton kernels on
    `logits`: auto on a CUDA device where Triton imports; triton needs both (ValueError)."""
    if kernel == "torch":
        return False
    if kernel not in ("auto", "triton"):
        raise ValueError(f"loss.logprob_kernel: {kernel!r} is not auto, torch or triton")
    ok = logits.is_cuda and importlib.util.find_spec("triton") is not None
    if kernel == "triton" and not ok:
        raise ValueError("loss.logprob_kernel: triton needs logits on a CUDA device and the "
                         "triton package")
    return ok


def logprob_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                    temperature_BS: torch.Tensor | None = None, entropy_grad: bool = False,
                    chunk: int = CHUNK, kernel: str = "torch"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] fp32 logprob of each label under softmax(logits / T) and the distribution's
    entropy (detached unless `entropy_grad`), computed `chunk` rows at a time, or by the
    Triton kernels (trainer.losses.logprobs_triton) where `kernel` (triton_runs) picks them."""
    b, s, v = logits_BSV.shape
    temp = None if temperature_BS is None else temperature_BS.reshape(-1)
    if triton_runs(logits_BSV, kernel):
        from trainer.losses.logprobs_triton import LogprobEntropyTriton

        lp, ent = LogprobEntropyTriton.apply(logits_BSV, labels_BS.reshape(-1).long(), temp)
    else:
        lp, ent = _LogprobEntropy.apply(logits_BSV.reshape(b * s, v),
                                        labels_BS.reshape(-1).long(), temp, chunk)
    return lp.view(b, s), (ent if entropy_grad else ent.detach()).view(b, s)


def token_logprobs(logits_BSV: torch.Tensor, labels_BS: torch.Tensor,
                   temperature_BS: torch.Tensor | None = None, kernel: str = "torch"
                   ) -> torch.Tensor:
    """trainer.losses.loss.token_logprobs, chunked or by the Triton kernels ([B, S] fp32)."""
    return logprob_entropy(logits_BSV, labels_BS, temperature_BS, kernel=kernel)[0]
