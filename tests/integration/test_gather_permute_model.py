"""model.moe_permute: gather in a whole model (issue 55) on CPU, one rank (real megatron-core
0.19.2, gloo, fp32, the tiny MoE checkpoint): every MoE layer is a GatherMoELayer whose
dispatcher skips megatron's local-expert sort (the tp x ep group is one rank, so the sort is
the identity), and the logits and every parameter's gradient equal planned dispatch's with
megatron's permute to fp32 rounding (the top-k sums run in another order). EP2 with r2 / r3
steps and MoE recompute: tests/integration/test_planned_dispatch.py; the switch:
tests/unit/test_gather_permute.py."""

from __future__ import annotations

import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=3,
                                                                        first_k_dense=1))


def _run(model_dir, permute: str):
    from trainer.megatron.model import ModelConfig, build_model, init_parallel

    cfg = ModelConfig(planned_dispatch=True, moe_permute=permute)
    init_parallel(cfg)
    built = build_model(model_dir, cfg)
    torch.manual_seed(0)
    tokens = torch.randint(4, 100, (3, 20))
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = built.module(input_ids=tokens, position_ids=pos, attention_mask=None)
    (logits.float() ** 2).mean().backward()
    grads = {k: p.grad.clone() for k, p in built.module.named_parameters() if p.grad is not None}
    return built, logits.detach(), grads


def test_gather_permute_model_equals_megatrons_permute(model_dir):
    from trainer.megatron.gather_permute import GatherAlltoAll, GatherMoELayer
    from trainer.megatron.planned_dispatch import planned_layers

    _, base, g_base = _run(model_dir, "megatron")
    built, got, g_got = _run(model_dir, "gather")
    layers = planned_layers(built.module)
    assert len(layers) == 2 and all(isinstance(m, GatherMoELayer) for m in layers)
    assert all(isinstance(m.token_dispatcher, GatherAlltoAll)
               and m.token_dispatcher._sort_is_identity() for m in layers)
    torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-6)
    assert set(g_got) == set(g_base)
    for k in g_base:
        torch.testing.assert_close(g_got[k], g_base[k], rtol=1e-5, atol=1e-7, msg=k)
