"""Replay hooks on HF routers (trainer.hf.routers), one tiny random model per router family.

The reference for "forced routing" is computed here by hand, independently of the hooks: a
forward hook on each MoE *block* replaces its output with sum_k w_k * expert_{id_k}(x) (+ shared
experts), where w is derived from the block's router weight with that family's normalisation.
Legend: B batch, S sequence, H hidden, T tokens, K top-k, E experts, L MoE layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.hf.routers import HFAgreementMonitor, HFModelReplay, find_routers
from trainer.replay import RoutingAgreementError

E, K, V = 8, 2, 64


def _common(**kw):
    return dict(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                num_attention_heads=4, num_experts_per_tok=K, max_position_embeddings=128,
                tie_word_embeddings=False) | {"num_key_value_heads": 2} | kw


def _configs():
    from transformers import DeepseekV3Config, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        "qwen3_moe": Qwen3MoeConfig(**_common(num_hidden_layers=2, num_experts=E, head_dim=8,
                                              norm_topk_prob=True)),
        "qwen2_moe": Qwen2MoeConfig(**_common(num_hidden_layers=2, num_experts=E,
                                              shared_expert_intermediate_size=32,
                                              norm_topk_prob=False)),
        "olmoe": OlmoeConfig(**_common(num_hidden_layers=2, num_experts=E, norm_topk_prob=False)),
        "deepseek_v3": DeepseekV3Config(**_common(
            num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=E, n_shared_experts=1,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8)),
    }


FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(FAMILIES.index(request.param))
    m = AutoModelForCausalLM.from_config(_configs()[request.param], dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if name.endswith("gate.weight") else 0.1)
        for r in find_routers(m):
            if hasattr(r.module, "e_score_correction_bias"):  # selection differs from scores
                r.module.e_score_correction_bias.normal_(0.0, 0.3)
    return m.eval()


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


# ---------------------------------------------------------------- the hand-forced reference
def hand_weights(block, x_TH, ids_TK):
    gate = block.gate
    logits_TE = x_TH.float() @ gate.weight.float().T
    if hasattr(gate, "e_score_correction_bias"):  # DeepSeek-V3: unbiased sigmoid scores
        w = logits_TE.sigmoid().gather(1, ids_TK)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else w
        return w * gate.routed_scaling_factor
    w = logits_TE.softmax(-1).gather(1, ids_TK)
    return w / w.sum(-1, keepdim=True) if gate.norm_topk_prob else w


def hand_moe(block, x_BSH, ids_TK):
    x = x_BSH.reshape(-1, x_BSH.shape[-1])
    w_TK, ex = hand_weights(block, x, ids_TK), block.experts
    out = torch.zeros_like(x)
    for k in range(ids_TK.shape[1]):
        e = ids_TK[:, k]
        g, u = torch.einsum("th,tfh->tf", x, ex.gate_up_proj[e]).chunk(2, -1)
        y = torch.einsum("tf,thf->th", F.silu(g) * u, ex.down_proj[e])
        out = out + w_TK[:, k:k + 1] * y
    if hasattr(block, "shared_expert"):  # Qwen2-MoE: sigmoid-gated shared expert
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if hasattr(block, "shared_experts"):  # DeepSeek-V3
        out = out + block.shared_experts(x)
    return out.view_as(x_BSH)


def forced_forward(model, tokens_BS, rows):
    """Logits with every MoE block computed by hand under the ids `rows[m]` ([B*S, K])."""
    handles = [b.register_forward_hook(lambda mod, inp, out, m=m: hand_moe(mod, inp[0], rows[m]))
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


def random_rows(n_layers, t, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
            for _ in range(n_layers)]


def natural_rows(model, tokens_BS):
    ctl = HFModelReplay(find_routers(model))
    try:
        ctl.record()
        with torch.no_grad():
            model(input_ids=tokens_BS, use_cache=False)
        return ctl.recorded()
    finally:
        ctl.remove()


def tokens(b=2, s=10, seed=0):
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- tests
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
    probe = torch.randn(*x.shape, V, generator=torch.Generator().manual_seed(5))
    grads = []
    for fwd in (replayed_forward, forced_forward):
        model.zero_grad(set_to_none=True)
        (fwd(model, x, rows) * probe).sum().backward()
        grads.append([r.module.weight.grad.clone() for r in find_routers(model)])
    model.zero_grad(set_to_none=True)
    for g_replay, g_hand in zip(*grads, strict=True):
        assert g_replay.abs().sum() > 0
        torch.testing.assert_close(g_replay, g_hand, atol=1e-5, rtol=1e-4)


def test_r2_reproduces_old_policy_routing_after_weight_change(model):
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


def test_packed_rows_equal_separate_forwards(model):
    a, b = tokens(1, 7, seed=7), tokens(1, 5, seed=8)
    ra, rb = (random_rows(len(moe_blocks(model)), t.numel(), seed=s) for t, s in ((a, 9), (b, 10)))
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
    rows = [torch.cat([x, y]) for x, y in zip(ra, rb, strict=True)]
    with torch.no_grad():
        got = replayed_forward(model, packed, rows, position_ids=pos)
        sep = torch.cat([replayed_forward(model, a, ra), replayed_forward(model, b, rb)], 1)
    torch.testing.assert_close(got, sep, atol=1e-5, rtol=1e-5)


def test_sequence_parallel_slices_replay_rows(model):
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


def test_agreement_one_for_own_routing_and_caught_when_shifted(model):
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


def test_gradient_checkpointing_recompute_replays_the_same_ids(model):
    x = tokens(seed=14)
    rows = random_rows(len(moe_blocks(model)), x.numel(), seed=15)
    probe = torch.randn(*x.shape, V, generator=torch.Generator().manual_seed(16))
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
