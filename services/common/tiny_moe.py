"""Build a small HF-format Qwen3-MoE model with a local character tokenizer (nothing downloaded).

Used by `r3flow model tiny-moe`, by `r3flow local` and by the tests. Dense leading layers
(`first_k_dense`) become Qwen3-MoE `mlp_only_layers`, the same shape as DeepSeek's
`first_k_dense_replace`: the engine reports routing rows for them too, the trainer must drop them.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from services.common.config import StrictConfig, multiple_of

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Character vocabulary: one token per printable character (space included), so any text the
# toy tasks produce round-trips through the tokenizer exactly.
CHARS = list(string.digits + string.ascii_letters + string.punctuation + " ")


class TinyMoeConfig(StrictConfig):
    """Sizes of the tiny MoE. moe_intermediate_size must be a multiple of 32 (vLLM-CPU kernels)."""

    hidden_size: int = Field(128, ge=16, description="model width")
    num_layers: int = Field(2, ge=1, description="decoder layers, dense ones included")
    first_k_dense: int = Field(0, ge=0, description="leading layers with a dense MLP")
    num_experts: int = Field(8, ge=2, le=1024)
    top_k: int = Field(2, ge=1)
    moe_intermediate_size: Annotated[int, Field(ge=32),
                                     multiple_of(32, "vLLM-CPU fused-MoE prepack")] = 64
    intermediate_size: int = Field(256, ge=32, description="dense-layer MLP width")
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=8)
    max_position_embeddings: int = Field(1024, ge=64)
    init_std: float = Field(0.08, gt=0, description="std of the random init (not near-uniform routing)")
    router_aux_loss_coef: float = Field(
        0.0, ge=0, le=1, description="load-balancing loss of the model's training (the HF "
        "config's router_aux_loss_coef; Qwen3-30B-A3B's is 0.001): the warm start trains with "
        "megatron's aux_loss at this coefficient, which keeps its routers near-balanced with "
        "real top-k margins (docs/benchmarks/gpu-loop.md, router margins); GRPO steps do not")
    seed: int = 0


def build_tokenizer():
    """A character-level fast tokenizer (WordLevel over single characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                     unk_token="<unk>", pad_token="<pad>")
    hf_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return hf_tok


def vocab_size() -> int:
    """Vocabulary size rounded up to a multiple of 64 (unused ids are never produced by text)."""
    n = len(SPECIAL_TOKENS) + len(CHARS)
    return (n + 63) // 64 * 64


def hf_config(cfg: TinyMoeConfig):
    """The transformers Qwen3MoeConfig for `cfg`."""
    from transformers import Qwen3MoeConfig

    if cfg.first_k_dense >= cfg.num_layers:
        raise ValueError("first_k_dense: must leave at least one MoE layer")
    if cfg.top_k > cfg.num_experts:
        raise ValueError("top_k: must be <= num_experts")
    # head_dim and dtype go through **kwargs in transformers 5 (not in the typed signature).
    extra: dict[str, Any] = {"head_dim": cfg.head_dim, "dtype": "float32"}
    return Qwen3MoeConfig(
        vocab_size=vocab_size(), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, decoder_sparse_step=1,
        mlp_only_layers=list(range(cfg.first_k_dense)), norm_topk_prob=True,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False,
        **extra,
    )


def build_tiny_moe(out_dir: str | Path, cfg: TinyMoeConfig | None = None) -> Path:
    """Write a seeded random-init tiny MoE (safetensors + config + tokenizer) to `out_dir`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    cfg = cfg or TinyMoeConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(hf_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, cfg.init_std)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out
