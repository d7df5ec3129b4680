"""model.batch_first_logits (issue 44) on a CUDA GPU in bf16: the logits GPTModel returns are the
output layer's own [B, S, V] tensor (no transpose copy), equal to megatron's own logits to bf16
rounding, and so are the gradients. The CPU counterpart (fp32, bit for bit):
tests/integration/test_batch_first_logits.py.

    python -m pytest tests/gpu/test_batch_first_logits_gpu.py -q -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


def _cpu_test():
    spec = importlib.util.spec_from_file_location(
        "batch_first_cpu", REPO / "tests/integration/test_batch_first_logits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=2,
                                                                        first_k_dense=1))


def test_batch_first_logits_on_cuda_bf16(model_dir):
    cpu = _cpu_test()
    torch.manual_seed(0)
    tokens = torch.randint(4, 100, (3, 40), device="cuda")
    model = {"dtype": "bf16", "experts": "grouped", "attention": "sdpa"}
    base, base_own, g_base = cpu._run(cpu._build(model_dir, **model, batch_first_logits=False),
                                      tokens)
    first, first_own, g_first = cpu._run(cpu._build(model_dir, **model,
                                                    batch_first_logits=True), tokens)
    assert first.dtype == torch.bfloat16 and first.is_cuda and first.is_contiguous()
    assert tuple(first.shape) == tuple(base.shape) == (3, 40, base.shape[-1])
    assert not base_own and first_own  # megatron copies its [S, B, V] logits; this does not
    diff = (first.float() - base.float()).abs().max().item()
    print(f"max |logit diff| {diff:.3g} (bf16), exact {torch.equal(first, base)}")
    assert torch.allclose(first.float(), base.float(), rtol=2**-7, atol=1e-3), diff
    assert set(g_first) == set(g_base)
    for k in g_base:
        err = (g_first[k].float() - g_base[k].float()).norm().item()
        assert err <= 1e-2 * g_base[k].float().norm().item() + 1e-6, (k, err)
