"""RoPE scaling on the megatron path: the tiny Qwen3-MoE with linear / llama3 / yarn RoPE scaling
in its config.json gives the same logits in megatron-core (1 rank, CPU) as in HF transformers
under the same forced routing, at positions past the original context where scaling matters."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)
SEQ = 96

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 0.5, "beta_fast": 16.0},
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(
        num_layers=2, first_k_dense=1, max_position_embeddings=128))


def _with_rope(base_dir, tmp_path, rope: dict):
    import shutil

    out = tmp_path / "model"
    shutil.copytree(base_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
    cfg["rope_parameters"] = {"rope_theta": theta, **rope}
    cfg.pop("rope_scaling", None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_logits(model_dir, tokens_BS, forced_BSK):
    """HF fp32 logits with the one MoE layer's top-k forced (gate weights from live logits)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = hf.model.rotary_emb  # recomputed: transformers 5 may skip it under a process group
    init = ROPE_INIT_FUNCTIONS.get(rope.rope_type, rope.compute_default_rope_parameters)
    inv, scale = init(hf.config)
    rope.inv_freq.copy_(inv)
    rope.original_inv_freq.copy_(inv)
    rope.attention_scaling = scale
    gate = hf.model.layers[1].mlp.gate
    ids = forced_BSK.reshape(-1, forced_BSK.shape[-1]).long()

    def hook(mod, inp, out):
        w = torch.softmax(out[0].float().gather(-1, ids), -1).to(out[0].dtype)
        return out[0], w, ids
    h = gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hf(tokens_BS).logits
    finally:
        h.remove()


def _megatron_logits(model_dir, tokens_BS, forced_BSK):
    from trainer.megatron.config import ModelConfig
    from trainer.megatron.model import build_model, init_parallel
    from trainer.megatron.replay import ModelReplay
    from trainer.samples.alignment import to_router_rows

    cfg = ModelConfig()
    init_parallel(cfg)
    built = build_model(model_dir, cfg)
    replay = ModelReplay(built.replays, recompute=False)
    replay.replay_forward(to_router_rows(forced_BSK[:, :, None, :]))
    b, s = tokens_BS.shape
    try:
        with torch.no_grad():
            return built.module(input_ids=tokens_BS, position_ids=torch.arange(s).expand(b, s),
                                attention_mask=None)
    finally:
        replay.end_step()


@pytest.mark.parametrize("name", list(ROPES))
def test_scaled_rope_logits_match_hf(base_dir, tmp_path, name):
    model_dir = _with_rope(base_dir, tmp_path, ROPES[name])
    rng = np.random.default_rng(1)
    tokens = torch.from_numpy(rng.integers(4, 100, (2, SEQ)))
    forced = torch.from_numpy(np.stack([rng.permutation(8)[:2] for _ in range(2 * SEQ)]))
    forced = forced.view(2, SEQ, 2)
    want = _hf_logits(model_dir, tokens, forced)
    plain = _hf_logits(base_dir, tokens, forced)
    assert (want - plain).abs().max() > 1e-2, "scaling must matter at these positions"
    torch.testing.assert_close(_megatron_logits(model_dir, tokens, forced), want,
                               atol=2e-4, rtol=2e-4)


def test_dynamic_ntk_is_refused_by_name(base_dir, tmp_path):
    from trainer.megatron.hf_mapping import load_arch

    model_dir = _with_rope(base_dir, tmp_path, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_scaling\.type: 'dynamic'"):
        load_arch(model_dir)
