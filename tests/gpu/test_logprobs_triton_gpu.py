"""Issue 44: the Triton log-softmax (trainer.losses.logprobs_triton, loss.logprob_kernel: triton)
against the chunked torch path it replaces (trainer.losses.logprobs, itself tested against
torch.log_softmax on CPU in tests/unit/test_logprobs.py): logprobs, entropy and the logits
gradient, fresh random inputs each case, a Qwen3-sized vocabulary (151,936: not a multiple of
the kernel's block), bf16 and fp32 logits, with and without temperature and the entropy's
gradient, contiguous [B, S, V] logits and megatron's [S, B, V] transposed view (read in place:
the gradient keeps its strides). Every gradient element is checked (the buffer is poisoned).

    python -m pytest tests/gpu/test_logprobs_triton_gpu.py -q -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from trainer.losses.logprobs import logprob_entropy, triton_runs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]
V = 151_936


def _case(dtype, transposed: bool, temperature: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s = 2, 96
    if transposed:  # a view of an [S, B, V] tensor, as megatron's output is before .contiguous()
        logits = (torch.randn(s, b, V, generator=g, device="cuda") * 4).to(dtype).transpose(0, 1)
    else:
        logits = (torch.randn(b, s, V, generator=g, device="cuda") * 4).to(dtype)
    labels = torch.randint(0, V, (b, s), generator=g, device="cuda")
    temp = torch.rand(b, s, generator=g, device="cuda") + 0.5 if temperature else None
    w_lp = torch.randn(b, s, generator=g, device="cuda")
    w_ent = torch.randn(b, s, generator=g, device="cuda")
    return logits, labels, temp, w_lp, w_ent


def _leaf(logits: torch.Tensor) -> torch.Tensor:
    """A fresh leaf copy of `logits` with the same strides."""
    x = torch.empty_strided(logits.shape, logits.stride(), dtype=logits.dtype,
                            device=logits.device)
    return x.copy_(logits).requires_grad_(True)


def _run(logits, labels, temp, w_lp, w_ent, kernel: str, entropy_grad: bool):
    x = _leaf(logits)
    lp, ent = logprob_entropy(x, labels, temp, entropy_grad=entropy_grad, kernel=kernel)
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0)
    loss.backward()
    return lp, ent, x.grad, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("temperature,entropy_grad", [(False, False), (True, True)])
def test_triton_matches_the_chunked_torch_path(dtype, transposed, temperature, entropy_grad):
    assert triton_runs(torch.empty(1, device="cuda"), "triton")
    seed = 1 + transposed + 2 * temperature + 4 * (dtype == torch.float32)
    case = _case(dtype, transposed, temperature, seed)
    lp, ent, grad, x = _run(*case, "triton", entropy_grad)
    ref_lp, ref_ent, ref_grad, _ = _run(*case, "torch", entropy_grad)
    assert grad.stride() == x.stride() and grad.dtype == dtype
    assert torch.isfinite(grad).all() and torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp - ref_lp).abs().max().item() < 2e-5, (lp - ref_lp).abs().max()
    assert (ent - ref_ent).abs().max().item() < 2e-5, (ent - ref_ent).abs().max()
    # elementwise: both are fp32 arithmetic apart by ~1e-6 relative to p (the entropy term's
    # logp + H may cancel: bounded through p), then one rounding to the logits' dtype
    logits, _, temp, w_lp, w_ent = case
    t = 1.0 if temp is None else temp.unsqueeze(-1)
    p = torch.softmax(logits.float() / t, -1)
    scale = (w_lp.abs() + (20 * w_ent.abs() if entropy_grad else 0)).unsqueeze(-1) / t
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    bound = rtol * ref_grad.float().abs() + 1e-5 * p * scale
    bad = (grad.float() - ref_grad.float()).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} gradient elements off"


def test_every_gradient_element_is_written():
    """The backward kernel on a NaN-poisoned gradient buffer overwrites every element."""
    from trainer.losses.logprobs_triton import BLOCK, _bwd, _rows

    logits, labels, _, w_lp, _ = _case(torch.bfloat16, True, False, 7)
    n, s, sb, ss = _rows(logits)
    lse = torch.logsumexp(logits.float(), -1).reshape(-1)
    grad = torch.full_like(logits, float("nan"))
    glp = w_lp.reshape(-1).contiguous()
    _bwd[(n,)](logits, grad, sb, ss, s, V, labels.reshape(-1).contiguous(), lse, lse, lse,
               glp, lse, HAS_T=False, HAS_GLP=True, HAS_GENT=False, BLOCK=BLOCK, num_warps=8)
    assert torch.isfinite(grad).all()
    p = torch.softmax(logits.float(), -1)
    want = -p * w_lp.unsqueeze(-1)
    want.scatter_add_(-1, labels.unsqueeze(-1), w_lp.unsqueeze(-1))
    assert torch.allclose(grad.float(), want, rtol=2 ** -7, atol=1e-7)


def test_the_old_policy_and_update_passes_agree_bitwise():
    """The same kernel in the no-grad old-policy pass (trainer.grpo._logprobs) and the loss:
    equal logits give equal logprobs, so an on-policy ratio is exactly 1."""
    logits, labels, _, _, _ = _case(torch.bfloat16, True, False, 11)
    with torch.no_grad():
        a, _ = logprob_entropy(logits, labels, kernel="triton")
    b, _ = logprob_entropy(logits.detach().clone().requires_grad_(True), labels, kernel="triton")
    assert torch.equal(a, b.detach())
