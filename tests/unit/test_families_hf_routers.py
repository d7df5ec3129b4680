"""HF-backend replay hooks on every model family's router (tiny models from services.rollout.families).

The reference for "forced routing" is computed here, independently of the hooks: a forward hook
on each MoE block replaces its output with the block's own experts run on the forced ids under
gate weights derived by hand from that family's router (+ the shared expert, gated or not).
Legend: B batch, S sequence, H hidden, T tokens, K top-k, E experts.
"""

from __future__ import annotations

import pytest
import torch

from services.rollout.families import FAMILIES, hf_config
from services.rollout.tiny_moe import TinyMoeConfig
from trainer.hf.routers import HFModelReplay, find_routers

E, K = 8, 2
DENSE_FIRST = {"qwen2_moe", "deepseek_v3", "glm4_moe"}  # families with leading dense layers


def tiny(family: str) -> TinyMoeConfig:
    return TinyMoeConfig(hidden_size=32, num_layers=3 if family in DENSE_FIRST else 2,
                         first_k_dense=int(family in DENSE_FIRST), num_experts=E, top_k=K,
                         moe_intermediate_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "qwen3_moe"])
def model(request):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(FAMILIES.index(request.param))
    m = AutoModelForCausalLM.from_config(hf_config(request.param, tiny(request.param)),
                                         dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if "gate.weight" in name or "router." in name else 0.1)
        for r in find_routers(m):
            if hasattr(r.module, "e_score_correction_bias"):  # selection differs from scores
                r.module.e_score_correction_bias.normal_(0.0, 0.3)
    return m.eval()


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def router_of(block):
    return block.gate if hasattr(block, "gate") else block.router


def hand_weights(router, x_TH, ids_TK):
    """Gate weights of the forced ids, written out per family from the upstream router code."""
    logits_TE = x_TH.float() @ router.weight.float().T
    name = type(router).__name__
    if name.startswith(("DeepseekV3", "Glm4Moe")):  # unbiased sigmoid scores, renorm, scale
        w = logits_TE.sigmoid().gather(1, ids_TK)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if router.norm_topk_prob else w
        return w * router.routed_scaling_factor
    if name.startswith("GptOss"):  # biased logits, softmax over the k chosen
        return (logits_TE + router.bias).gather(1, ids_TK).softmax(-1)
    w = logits_TE.softmax(-1).gather(1, ids_TK)
    renorm = name.startswith("Mixtral") or router.norm_topk_prob
    return w / w.sum(-1, keepdim=True) if renorm else w


def hand_moe(block, x_BSH, ids_TK):
    x = x_BSH.reshape(-1, x_BSH.shape[-1])
    out = block.experts(x, ids_TK, hand_weights(router_of(block), x, ids_TK))
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: sigmoid-gated shared expert
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if hasattr(block, "shared_experts"):  # DeepSeek-V3, GLM-4.x: ungated
        out = out + block.shared_experts(x)
    return out.view_as(x_BSH)


def forced_forward(model, tokens_BS, rows):
    def hook(mod, inp, out, m):
        y = hand_moe(mod, inp[0], rows[m])
        return (y, out[1]) if isinstance(out, tuple) else y  # GPT-OSS returns (y, scores)

    handles = [b.register_forward_hook(lambda mod, inp, out, m=m: hook(mod, inp, out, m))
               for m, b in enumerate(moe_blocks(model))]
    try:
        return model(input_ids=tokens_BS, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


def replayed_forward(model, tokens_BS, rows):
    ctl = HFModelReplay(find_routers(model))
    try:
        ctl.replay_forward(rows)
        return model(input_ids=tokens_BS, use_cache=False).logits
    finally:
        ctl.remove()


def natural_rows(model, tokens_BS):
    ctl = HFModelReplay(find_routers(model))
    try:
        ctl.record()
        with torch.no_grad():
            model(input_ids=tokens_BS, use_cache=False)
        return ctl.recorded()
    finally:
        ctl.remove()


def random_rows(n_layers, t, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
            for _ in range(n_layers)]


def tokens(b=2, s=10, seed=0):
    return torch.randint(4, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def test_every_family_has_its_routers_found(model):
    routers = find_routers(model)
    assert [r.hf_layer for r in routers] == \
        [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert {(r.num_experts, r.top_k) for r in routers} == {(E, K)}


def test_replay_equals_hand_forced_forward(model):
    x = tokens()
    rows = random_rows(len(moe_blocks(model)), x.numel(), seed=1)
    assert any(not torch.equal(n.sort(-1).values, r.sort(-1).values)
               for n, r in zip(natural_rows(model, x), rows, strict=True))
    with torch.no_grad():
        got, want = replayed_forward(model, x, rows), forced_forward(model, x, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_replaying_the_routers_own_choice_is_the_native_forward(model):
    x = tokens(seed=2)
    with torch.no_grad():
        native = model(input_ids=x, use_cache=False).logits
        got = replayed_forward(model, x, natural_rows(model, x))
    torch.testing.assert_close(got, native, atol=1e-6, rtol=1e-6)


def test_router_gradients_match_hand_forced(model):
    x = tokens(seed=3)
    rows = random_rows(len(moe_blocks(model)), x.numel(), seed=4)
    probe = torch.randn(*x.shape, model.config.vocab_size,
                        generator=torch.Generator().manual_seed(5))
    grads = []
    for fwd in (replayed_forward, forced_forward):
        model.zero_grad(set_to_none=True)
        (fwd(model, x, rows) * probe).sum().backward()
        grads.append([r.module.weight.grad.clone() for r in find_routers(model)])
    model.zero_grad(set_to_none=True)
    for g_replay, g_hand in zip(*grads, strict=True):
        assert g_replay.abs().sum() > 0
        torch.testing.assert_close(g_replay, g_hand, atol=1e-5, rtol=1e-4)


def test_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="family: 'deepseek_v2' is not one of"):
        hf_config("deepseek_v2", TinyMoeConfig())


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss"])
def test_all_moe_families_refuse_dense_layers(family):
    with pytest.raises(ValueError, match=f"first_k_dense: {family} has no dense layers"):
        hf_config(family, TinyMoeConfig(num_layers=2, first_k_dense=1))
