"""Rollout engines sized for the model (issue 42): the tensor-parallel size of one vLLM engine
and how many engines share a node, from the model's size rather than the node's.

A MoE model with few active parameters (Qwen3-30B-A3B: 3.3B of 30.5B) decodes fastest on the
smallest engines that still hold the whole batch's KV cache: each engine runs its own batch
(data parallel), and every extra TP rank adds an all-reduce per layer to every decode step. So
the plan takes the smallest power-of-two TP whose engine holds, inside
`gpu_memory_utilization` of its GPUs, the weights (bf16, or FP8 linears with
`engine.quantization: fp8`; split over TP) plus the KV cache of `max_num_seqs` sequences of
`max_model_len` tokens (vLLM's worst case for the engine's batch; per token and layer the
family's attention decides it: GQA's KV heads split over TP, at least one per rank, MLA's latent
and rope key whole on every rank, a sliding-window layer only its window);
node_gpus / TP engines then share one node. The chart runs one engine per rollout pod
(`rollout.gpus` = TP), so several pods share a node; chart-check refuses a rendered rollout whose
TP is not the plan's (annotations r3flow.io/plan-model and r3flow.io/plan-gpu-memory-gib).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import UserError
from trainer.plan.layout import Arch, GiB

ACTIVATION_GIB = 2.0  # vLLM's profiled activation peak + CUDA graphs' pool, per GPU (estimate)


@dataclass(frozen=True)
class RolloutPlan:
    """One engine's layout and memory (bytes per GPU unless said)."""

    tp: int
    engines_per_node: int
    weights_per_gpu: float
    kv_per_engine: float  # bytes of KV cache the engine gets
    kv_tokens: int  # tokens that fit in it
    need_tokens: int  # max_num_seqs x max_model_len
    active_params: int
    total_params: int

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.need_tokens

    def describe(self, label: str = "") -> str:
        verdict = "holds the batch" if self.fits else "DOES NOT hold the batch"
        return (f"{label}\n  rollout engine: TP {self.tp}, {self.engines_per_node} engine(s) per "
                f"node ({self.active_params / 1e9:.1f}B active of {self.total_params / 1e9:.1f}B "
                f"params)\n  weights {self.weights_per_gpu / GiB:.2f} GiB per GPU, KV cache "
                f"{self.kv_per_engine / GiB:.2f} GiB per engine = {self.kv_tokens:,} tokens of "
                f"{self.need_tokens:,} needed: {verdict}")


def kv_bytes_per_token(arch: Arch, tp: int = 1, seq_len: int = 0, dtype_bytes: int = 2) -> float:
    """K and V of every layer for one token on one of `tp` engine ranks (the family's attention:
    GQA splits its KV heads over the ranks, MLA keeps its latent on every rank); with `seq_len`,
    a sliding-window layer counts for its window's share of a sequence that long (vLLM's
    hybrid KV cache keeps only the window there)."""
    layers = arch.kv_layers(seq_len) if seq_len else arch.num_layers
    return layers * arch.attention.kv_cache_elems(tp) * dtype_bytes


def engine_weight_bytes(arch: Arch, quantization: str = "none") -> float:
    """The engine's weights: bf16, or with vLLM's online FP8 one byte per parameter of every
    linear layer (attention, MLPs, experts; per-tensor scales negligible) while the
    embeddings, output layer, norms and routers stay bf16."""
    if quantization == "none":
        return arch.total_params() * 2.0
    emb = arch.vocab * arch.hidden * (1 if arch.tied_embeddings else 2)
    kept = emb + arch.hidden * (2 * arch.num_layers + 1) + arch.moe_layers * arch.hidden * arch.experts
    return (arch.total_params() - kept) * 1.0 + kept * 2.0


def engine_plan(arch: Arch, tp: int, gpu_gib: float, util: float, max_model_len: int,
                max_num_seqs: int, node_gpus: int, quantization: str = "none") -> RolloutPlan:
    weights = engine_weight_bytes(arch, quantization) / tp
    usable = gpu_gib * GiB * util - ACTIVATION_GIB * GiB
    free = max(0.0, usable - weights)  # per GPU
    tokens = int(free // kv_bytes_per_token(arch, tp, max_model_len))
    return RolloutPlan(tp, node_gpus // tp, weights, free * tp, tokens,
                       max_num_seqs * max_model_len, arch.active_params(), arch.total_params())


def plan_rollout(arch: Arch, gpu_gib: float, util: float, max_model_len: int,
                 max_num_seqs: int, node_gpus: int = 8, quantization: str = "none"
                 ) -> RolloutPlan:
    """The smallest power-of-two TP (dividing the attention heads, at most node_gpus) whose
    engine holds its weights and its batch's KV cache."""
    if not 0 < util <= 1:
        raise UserError(f"gpu_memory_utilization {util}: must be in (0, 1]")
    tp, best = 1, None
    while tp <= node_gpus:
        if arch.heads % tp == 0:
            best = engine_plan(arch, tp, gpu_gib, util, max_model_len, max_num_seqs, node_gpus,
                               quantization)
            if best.fits:
                return best
        tp *= 2
    if best is None:
        raise UserError(f"no power-of-two TP up to {node_gpus} divides {arch.heads} heads")
    return best  # the largest: does not hold the batch (its verdict says so)
