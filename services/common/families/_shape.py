"""`ModelShape`: what a model's HF config.json says about its size, as its family reads it.

Each family module maps its own config.json keys to a `ModelShape` (`Family.shape`): which
layers are MoE and which dense, routed and shared experts and their widths, the attention
(grouped-query, or DeepSeek's multi-latent attention with its low-rank projections), the
vocabulary and whether the embeddings are tied. The planner (trainer/plan) counts parameters,
memory and KV cache from it and from nothing else, so a family whose keys differ from
Qwen3-MoE's is counted by its own reading, not by Qwen3-MoE's key names.
Parameter counts are those of the HF model transformers builds from the config (norms and
biases included; DeepSeek-V3/GLM's `e_score_correction_bias` is a buffer, not a parameter);
tests/unit/test_family_shape_agreement.py checks them against the HF model of each
family's tiny config, tests/unit/test_family_shapes.py against published model cards.
Legend: h hidden, E routed experts, f expert width, F dense width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

QkNorm = Literal["none", "head", "full"]  # none; per head (Qwen3); over the projection (OLMoE)
Embedding = Literal["input", "output"]


@dataclass(frozen=True)
class Attention:
    """One attention block: grouped-query, or multi-latent (MLA) when `kv_lora_rank` is set."""

    heads: int
    kv_heads: int  # MLA: = heads (every head gets its own k and v from the latent)
    head_dim: int  # width of one head's q and k (MLA: qk_nope_head_dim + qk_rope_head_dim)
    v_head_dim: int = 0  # width of one head's v (0: head_dim)
    q_lora_rank: int = 0  # MLA: rank of q's down-projection (0: one full q projection)
    kv_lora_rank: int = 0  # MLA: width of the kv latent (0: grouped-query attention)
    rope_head_dim: int = 0  # MLA: the rope part of head_dim (one rope key shared by all heads)
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: QkNorm = "none"
    sinks: bool = False  # a learned sink logit per head (GPT-OSS)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def v_width(self) -> int:
        return self.heads * (self.v_head_dim or self.head_dim)

    def params(self, hidden: int) -> tuple[int, int]:
        """(tensor-parallel split, replicated) parameters of the block (its layer norms not
        included): projections, biases and sinks split over heads, the output bias and the
        norms replicated."""
        if self.mla:
            return self._mla_params(hidden)
        kv = self.kv_heads * self.head_dim
        split = hidden * (self.q_width + 2 * kv) + self.q_width * hidden
        split += (self.q_width + 2 * kv) * self.qkv_bias + self.heads * self.sinks
        norms = {"none": 0, "head": 2 * self.head_dim, "full": self.q_width + kv}[self.qk_norm]
        return split, norms + hidden * self.out_bias

    def _mla_params(self, hidden: int) -> tuple[int, int]:
        q = (hidden * self.q_lora_rank + self.q_lora_rank * self.q_width if self.q_lora_rank
             else hidden * self.q_width)
        nope = self.head_dim - self.rope_head_dim
        kv = (hidden * (self.kv_lora_rank + self.rope_head_dim)
              + self.kv_lora_rank * self.heads * (nope + (self.v_head_dim or self.head_dim)))
        return q + kv + self.v_width * hidden, self.q_lora_rank + self.kv_lora_rank

    def kv_cache_elems(self, tp: int = 1) -> int:
        """Elements one token's K and V take in one layer on one of `tp` engine ranks: MLA
        caches its latent and rope key on every rank; GQA splits its KV heads over the ranks
        (a rank holds at least one, replicated when tp > kv_heads)."""
        if self.mla:
            return self.kv_lora_rank + self.rope_head_dim
        return 2 * max(1, self.kv_heads // tp) * self.head_dim


@dataclass(frozen=True)
class ModelShape:
    """The sizes of an MoE decoder as its family reads them from config.json."""

    num_layers: int
    moe_layer_ids: tuple[int, ...]  # decoder layers whose MLP is a routed MoE block
    hidden: int
    vocab: int
    attention: Attention
    experts: int
    top_k: int
    moe_ffn: int  # one routed expert's width
    dense_ffn: int  # a dense layer's MLP width (0: the family has no dense layers)
    shared_ffn: int = 0  # width of the shared expert(s) of an MoE layer, all together (0: none)
    shared_gate: bool = False  # the shared expert's sigmoid gate (Qwen2-MoE: h parameters)
    expert_bias: bool = False  # biased expert projections (GPT-OSS)
    router_bias: bool = False  # a router bias that is a parameter (GPT-OSS)
    # the checkpoint holds a layer's experts as one tensor per projection (GPT-OSS's
    # gate_up_proj [E, h, 2f]), not one per expert: the weight push's largest tensor
    fused_experts: bool = False
    # sliding-window attention layers and their window (GPT-OSS): vLLM's hybrid KV cache keeps
    # only the last `sliding_window` tokens of a sequence in those layers
    window_layers: int = 0
    sliding_window: int = 0
    tied_embeddings: bool = False
    # the embedding tables the family's published "active parameters" count (model cards
    # differ: Qwen, Mistral and OLMoE count both, DeepSeek and OpenAI the output layer only,
    # Z.ai neither); what `active_params` leaves out
    active_embeddings: tuple[Embedding, ...] = ("input", "output")

    @property
    def moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections (and their biases)."""
        return 3 * self.hidden * self.moe_ffn + (2 * self.moe_ffn + self.hidden) * self.expert_bias

    @property
    def expert_params_per_layer(self) -> int:
        return self.experts * self.expert_params

    def attention_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one attention block and its layer's two norms."""
        split, repl = self.attention.params(self.hidden)
        return split, repl + 2 * self.hidden

    def moe_dense_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of an MoE layer outside its routed experts: the
        shared expert (split) and the router and shared-expert gate (replicated)."""
        router = self.hidden * self.experts + self.experts * self.router_bias
        return 3 * self.hidden * self.shared_ffn, router + self.hidden * self.shared_gate

    def kv_layers(self, seq_len: int) -> float:
        """Layers' worth of KV cache one token of a `seq_len`-token sequence takes on average:
        every full-attention layer, a sliding-window layer for the window's share only."""
        if not self.window_layers:
            return float(self.num_layers)
        kept = min(seq_len, self.sliding_window) / seq_len
        return self.num_layers - self.window_layers + self.window_layers * kept

    def largest_tensor(self) -> int:
        """Elements of the checkpoint's largest single tensor (embedding or output layer, a
        dense or shared MLP projection, an expert's, or a fused expert tensor, an attention
        projection)."""
        a, h = self.attention, self.hidden
        experts = self.experts * 2 * self.moe_ffn if self.fused_experts else self.moe_ffn
        sizes = [h * w for w in (self.vocab, self.dense_ffn, self.shared_ffn, experts,
                                 a.q_width, a.v_width)]
        if a.mla:  # q_b_proj and kv_b_proj
            nope_v = a.head_dim - a.rope_head_dim + (a.v_head_dim or a.head_dim)
            sizes += [a.q_lora_rank * a.q_width, a.kv_lora_rank * a.heads * nope_v]
        return max(sizes)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        """Every parameter of the HF model (MTP layers, which the trainer drops, left out)."""
        split, repl = self.attention_params()
        moe_split, moe_repl = self.moe_dense_params()
        return (self.num_layers * (split + repl) + self.embedding_params() + self.hidden
                + self.moe_layers * (self.expert_params_per_layer + moe_split + moe_repl)
                + self.dense_layers * 3 * self.hidden * self.dense_ffn)

    def active_params(self) -> int:
        """Parameters one token runs through (top_k routed experts of each MoE layer), the
        embedding tables counted as the family's model cards count them."""
        routed = self.moe_layers * (self.experts - self.top_k) * self.expert_params
        tables = 1 if self.tied_embeddings else 2
        left_out = tables - min(tables, len(self.active_embeddings))
        return self.total_params() - routed - left_out * self.vocab * self.hidden


class ConfigKeys:
    """An HF config.json dict read by key; ValueError names a missing or non-numeric key."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg

    def num(self, key: str, default: int | None = None) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"missing key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ValueError(f"{key}: {value!r} is not an integer")
        return int(value)

    def num_of(self, *keys: str) -> int:
        """The first of `keys` the config sets (a key transformers renamed: both spellings)."""
        key = next((k for k in keys if self.cfg.get(k) is not None), None)
        if key is None:
            raise ValueError(f"missing key {keys[0]!r} (or {', '.join(map(repr, keys[1:]))})")
        return self.num(key)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.cfg.get(key)
        return default if value is None else bool(value)

    def ids(self, key: str) -> set[int]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            raise ValueError(f"{key}: {value!r} is not a list of layer indices")
        return set(value)


def gqa(k: ConfigKeys, **kw: Any) -> Attention:
    """Grouped-query attention from the usual keys (head_dim: hidden / heads when unset)."""
    heads = k.num("num_attention_heads")
    return Attention(heads=heads, kv_heads=k.num("num_key_value_heads", heads),
                     head_dim=k.num("head_dim", 0) or k.num("hidden_size") // heads, **kw)


def sparse_step_moe(k: ConfigKeys) -> tuple[int, ...]:
    """Qwen-MoE's MoE layers: every `decoder_sparse_step`-th, minus `mlp_only_layers`."""
    n, step, dense = k.num("num_hidden_layers"), k.num("decoder_sparse_step", 1), \
        k.ids("mlp_only_layers")
    if step < 1:
        raise ValueError(f"decoder_sparse_step: {step} must be >= 1")
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


def dense_first_moe(k: ConfigKeys, freq_key: str | None = None) -> tuple[int, ...]:
    """DeepSeek-style MoE layers: from `first_k_dense_replace` on (every `freq_key`-th)."""
    n, first = k.num("num_hidden_layers"), k.num("first_k_dense_replace", 0)
    freq = k.num(freq_key, 1) if freq_key else 1
    if freq < 1:
        raise ValueError(f"{freq_key}: {freq} must be >= 1")
    return tuple(i for i in range(n) if i >= first and i % freq == 0)


def every_layer_moe(k: ConfigKeys) -> tuple[int, ...]:
    return tuple(range(k.num("num_hidden_layers")))


def decoder(k: ConfigKeys) -> dict[str, Any]:
    """The ModelShape fields every family reads under the same keys."""
    return dict(num_layers=k.num("num_hidden_layers"), hidden=k.num("hidden_size"),
                vocab=k.num("vocab_size"), top_k=k.num("num_experts_per_tok"),
                tied_embeddings=k.flag("tie_word_embeddings"))
