"""Model configs the planner knows by name, so specs can be planned where the weights are not
(CI, a laptop): the HF config.json keys the estimate reads, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.errors import UserError, syntax_error

# Qwen/Qwen3-30B-A3B config.json (the keys trainer/hf_mapping.py and the planner read).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}


def tiny_moe_config() -> dict:
    """The HF config keys of `r3flow model tiny-moe` with its default sizes."""
    from services.common.tiny_moe import TinyMoeConfig, vocab_size

    c = TinyMoeConfig()
    return {"model_type": "qwen3_moe", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "num_experts": c.num_experts, "num_experts_per_tok": c.top_k,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(c.first_k_dense)),
            "vocab_size": vocab_size(), "tie_word_embeddings": False}


def known_names() -> list[str]:
    return ["Qwen3-30B-A3B", "tiny-moe"]


def load_model_config(source: str) -> dict:
    """`source`: a known name, an HF model directory or a config.json path."""
    if source == "Qwen3-30B-A3B":
        return dict(QWEN3_30B_A3B)
    if source == "tiny-moe":
        return tiny_moe_config()
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"model config: {source!r} is neither a known name "
                         f"({', '.join(known_names())}) nor a config.json / model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise syntax_error(path, e) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"model config {path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"model config {path}: not a JSON object")
    return data
