"""Replay hooks on HF routers (trainer.hf.routers) on a tiny random model of every MoE family
(services.common.families), and the replay mechanisms (R2, packing, sequence parallelism,
agreement, gradient checkpointing) on four of them.

The reference for "forced routing" is computed here, independently of the hooks: a forward hook
on each MoE block replaces its output with the block's own experts run on the forced ids under
gate weights derived by hand from that family's router (+ the shared expert, gated or not).
Legend: B batch, S sequence, H hidden, T tokens, K top-k, E experts, L MoE layers.
"""

from __future__ import annotations

import pytest
import torch

from services.common.families import hf_config, names
from services.common.tiny_moe import TinyMoeConfig
from services.common.tiny_moe import hf_config as qwen3_config
from trainer.hf.routers import HFAgreementMonitor, HFModelReplay, find_routers
from trainer.replay import RoutingAgreementError

E, K = 8, 2
DENSE_FIRST = {"qwen2_moe", "deepseek_v3", "glm4_moe"}  # families with leading dense layers
# the replay mechanisms below are family-independent: four routers (softmax renormalised or not,
# a gated shared expert, grouped sigmoid with a selection bias) cover their code paths
MECHANISM_FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3"]


def tiny(family: str) -> TinyMoeConfig:
    return TinyMoeConfig(hidden_size=32, num_layers=3 if family in DENSE_FIRST else 2,
                         first_k_dense=int(family in DENSE_FIRST), num_experts=E, top_k=K,
                         moe_intermediate_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def build(family: str):
    from transformers import AutoModelForCausalLM

    cfg = qwen3_config(tiny(family)) if family == "qwen3_moe" else hf_config(family, tiny(family))
    torch.manual_seed(names().index(family))
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if "gate.weight" in name or "router." in name else 0.1)
        for r in find_routers(m):
            if hasattr(r.module, "e_score_correction_bias"):  # selection differs from scores
                r.module.e_score_correction_bias.normal_(0.0, 0.3)
    return m.eval()


@pytest.fixture(scope="module", params=names())
def model(request):
    return build(request.param)


@pytest.fixture(scope="module", params=MECHANISM_FAMILIES)
def core_model(request):
    return build(request.param)


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


def replayed_forward(model, tokens_BS, rows, **kw):
    ctl = HFModelReplay(find_routers(model))
    try:
        ctl.replay_forward(rows)
        return model(input_ids=tokens_BS, use_cache=False, **kw).logits
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


def test_r2_reproduces_old_policy_routing_after_weight_change(core_model):
    model = core_model
    x = tokens(seed=6)
    old = natural_rows(model, x)
    routers = find_routers(model)
    saved = [r.module.weight.detach().clone() for r in routers]
    used: list[torch.Tensor] = []
    hooks = [b.experts.register_forward_pre_hook(lambda mod, args: used.append(args[1].clone()))
             for b in moe_blocks(model)]
    try:
        with torch.no_grad():
            for r in routers:
                r.module.weight.add_(torch.randn_like(r.module.weight))
            moved = natural_rows(model, x)
            used.clear()
            got = replayed_forward(model, x, old)
            want = forced_forward(model, x, old)
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for r, w in zip(routers, saved, strict=True):
                r.module.weight.copy_(w)
    assert any(not torch.equal(a, b) for a, b in zip(old, moved, strict=True))
    assert all(torch.equal(u, o) for u, o in zip(used[:len(old)], old, strict=True))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_separate_forwards(core_model):
    model = core_model
    a, b = tokens(1, 7, seed=7), tokens(1, 5, seed=8)
    ra, rb = (random_rows(len(moe_blocks(model)), t.numel(), seed=s) for t, s in ((a, 9), (b, 10)))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    rows = [torch.cat([x, y]) for x, y in zip(ra, rb, strict=True)]
    with torch.no_grad():
        got = replayed_forward(model, packed, rows, position_ids=pos)
        sep = torch.cat([replayed_forward(model, a, ra), replayed_forward(model, b, rb)], 1)
    torch.testing.assert_close(got, sep, atol=1e-5, rtol=1e-5)


def test_sequence_parallel_slices_replay_rows(core_model):
    model = core_model
    block, router = moe_blocks(model)[0], find_routers(model)[:1]
    h_BSH = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(11))
    rows = random_rows(1, 12, seed=12)
    ctl = HFModelReplay(router)
    try:
        with torch.no_grad():
            ctl.replay_forward(rows)
            full = block(h_BSH)
            parts = []
            for rank in range(3):
                ctl.replay_forward(rows, sp_rank=rank, sp_size=3)
                parts.append(block(h_BSH[:, rank * 4:(rank + 1) * 4]))
            with pytest.raises(ValueError, match="replay rows"):
                ctl.replay_forward(rows)
                block(h_BSH[:, :4])
    finally:
        ctl.remove()
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-6, rtol=1e-6)


def test_agreement_one_for_own_routing_and_caught_when_shifted(core_model):
    model = core_model
    x = tokens(seed=13)
    routers = find_routers(model)
    mon = HFAgreementMonitor(tuple(r.hf_layer for r in routers), K, E)
    ctl = HFModelReplay(routers, mon)
    own = natural_rows(model, x)
    try:
        with torch.no_grad():
            ctl.replay_forward(own)
            model(input_ids=x, use_cache=False)
            assert mon.overall() == 1.0
            mon.check(0.9)
            mon.reset()
            ctl.replay_forward([torch.roll(r, 1, 0) for r in own])  # off by one row
            model(input_ids=x, use_cache=False)
    finally:
        ctl.remove()
    with pytest.raises(RoutingAgreementError, match=r"MoE layer \d \(HF layer \d\)"):
        mon.check(0.9)


def test_unknown_router_family_is_refused():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = torch.nn.Linear(4, E), torch.nn.Linear(4, 4)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Block()

    lm = torch.nn.Module()
    lm.model = torch.nn.Module()
    lm.model.layers = torch.nn.ModuleList([Layer()])
    with pytest.raises(ValueError, match="Linear at layer 0 is not a supported router family"):
        find_routers(lm)


def test_gradient_checkpointing_recompute_replays_the_same_ids(core_model):
    model = core_model
    x = tokens(seed=14)
    rows = random_rows(len(moe_blocks(model)), x.numel(), seed=15)
    probe = torch.randn(*x.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(16))
    grads = []
    model.train()
    try:
        for ckpt in (False, True):
            if ckpt:
                model.gradient_checkpointing_enable()
            model.zero_grad(set_to_none=True)
            ctl = HFModelReplay(find_routers(model))
            ctl.replay_forward(rows)  # ids stay set through backward's recompute
            (model(input_ids=x, use_cache=False).logits * probe).sum().backward()
            ctl.remove()
            grads.append([r.module.weight.grad.clone() for r in find_routers(model)])
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        model.eval()
    for plain_g, ckpt_g in zip(*grads, strict=True):
        torch.testing.assert_close(ckpt_g, plain_g, atol=1e-6, rtol=1e-5)
