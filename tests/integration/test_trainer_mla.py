"""DeepSeek-V3's multi-latent attention on the megatron path (trainer.megatron.family_deepseek_v3):
a tiny all-dense DeepSeek-V3 (MLA without a router in the way) gives the same fp32 logits in
megatron-core (1 rank, CPU) as in HF transformers, for every attention variant the real
checkpoints use: q_lora_rank set (DeepSeek-V3, Kimi-K2) or None (Moonlight), the interleaved
rope (rope_interleave true, the default) and the half-rotation one (false: the rope rows are
permuted on load), plain rope (Moonlight) and YaRN with DeepSeek's mscale / mscale_all_dim, at positions
past the original context where YaRN matters. Each variant is checked to change HF's logits, so
a mapping that ignored it would fail."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
SEQ = 80
# fp32 logits: measured ~4e-6 on logits of magnitude ~4
TOL = 2e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}
VARIANTS = {
    "q_lora": {},
    "no_q_lora": {"q_lora_rank": None},
    "rope_halves": {"rope_interleave": False},
    # DeepSeek-V3 / Kimi-K2: mscale == mscale_all_dim == 1 (rope factor 1, softmax mscale^2)
    "yarn_deepseek": {"rope_parameters": YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}},
    "yarn_mscale": {"rope_parameters": YARN | {"mscale": 0.707, "mscale_all_dim": 0.5,
                                               "beta_fast": 16.0}},
    "yarn_plain": {"rope_parameters": YARN},
}


def _build(out, **over):
    """All-dense tiny DeepSeek-V3 (random weights, norms too) with `over` config fields; plain
    RoPE unless `over` sets rope_parameters (the tiny builder's default is DeepSeek's YaRN)."""
    from transformers import AutoModelForCausalLM

    from services.common.families import hf_config
    from services.common.tiny_moe import TinyMoeConfig

    cfg = hf_config("deepseek_v3", TinyMoeConfig(num_layers=2, first_k_dense=1,
                                                 max_position_embeddings=128))
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    for k, v in ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
                 | over).items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.08)
    model.save_pretrained(out)
    return out


def _hf_logits(model_dir, tokens):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from family_chain import load_plain

    with torch.no_grad():
        return load_plain(model_dir)(tokens).logits


def _megatron_logits(model_dir, tokens):
    from trainer.megatron.config import ModelConfig
    from trainer.megatron.model import build_model, init_parallel

    cfg = ModelConfig()
    init_parallel(cfg)
    built = build_model(model_dir, cfg)
    assert built.config.multi_latent_attention
    b, s = tokens.shape
    with torch.no_grad():
        return built.module(input_ids=tokens, position_ids=torch.arange(s).expand(b, s),
                            attention_mask=None)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(4, 100, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base_logits(tmp_path_factory, tokens):
    return _hf_logits(_build(tmp_path_factory.mktemp("base")), tokens)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mla_logits_match_hf(tmp_path, tokens, base_logits, name):
    model_dir = _build(tmp_path / "model", **VARIANTS[name])
    want = _hf_logits(model_dir, tokens)
    if name != "q_lora":
        assert (want - base_logits).abs().max() > 1e-2, f"{name} must change HF's logits"
    torch.testing.assert_close(_megatron_logits(model_dir, tokens), want, atol=TOL, rtol=TOL)
