"""The parallel layout of the megatron trainer: boot checks, weight sharding and gathering.

`check_layout` validates a ModelConfig layout against the world size and the architecture
(errors name the field). `shard_full` turns the full (TP=1, PP=1) megatron parameter dict of the
HF mapping into this rank's parameters (pipeline stage's layers renamed to local indices,
tensor-parallel slices cut as megatron's layers hold them); `gather_full` is its inverse (the
HF export, a collective over TP, expert-TP and PP). `stage_moe_layers` / `local_positions` say
which MoE layers and which sequence positions this rank routes (trainer.samples.alignment cuts the
routing rows with them).
Legend: S sequence (padded), H hidden.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def check_layout(cfg: Any, world: int, arch: Any | None = None, pad_multiple: int = 0) -> int:
    """Validate `cfg` (a ModelConfig) for `world` ranks (and `arch`, a MoeArch, when given);
    returns the data-parallel size. ValueError names the field."""
    tp, pp, cp, ep, etp = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel,
                           cfg.expert_parallel, cfg.expert_tensor_parallel)
    if world % (tp * pp * cp):
        raise ValueError(f"model.tensor_parallel x pipeline_parallel x context_parallel = "
                         f"{tp * pp * cp} does not divide the world size {world}")
    if world % (etp * ep * pp):
        raise ValueError(f"model.expert_tensor_parallel x expert_parallel x pipeline_parallel = "
                         f"{etp * ep * pp} does not divide the world size {world}")
    if tp > 1 and not cfg.sequence_parallel:
        raise ValueError("model.sequence_parallel: must be true with tensor_parallel > 1 (megatron"
                         "-core's MoE layer refuses to train TP without sequence parallelism)")
    if cp > 1:
        raise ValueError("model.context_parallel: megatron-core 0.19's local attention "
                         "(DotProductAttention, the non-TransformerEngine spec) supports only 1; "
                         "context parallelism needs TransformerEngine's TEDotProductAttention")
    if pad_multiple:
        shard = (tp if cfg.sequence_parallel else 1) * 2 * cp if cp > 1 else \
            (tp if cfg.sequence_parallel else 1)
        if pad_multiple % shard:
            raise ValueError(f"data.pad_multiple {pad_multiple}: sequences are cut into {shard} "
                             "shards (sequence_parallel x 2*context_parallel); make it a multiple")
    if arch is not None:
        _check_arch(cfg, arch)
    return world // (tp * pp * cp)


def _check_arch(cfg: Any, a: Any) -> None:
    tp, pp, ep, etp = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel,
                       cfg.expert_tensor_parallel)
    checks = [
        (a.num_heads % tp, f"model.tensor_parallel {tp}: does not divide the {a.num_heads} "
                           "attention heads"),
        (a.num_kv_heads % tp, f"model.tensor_parallel {tp}: does not divide the "
                              f"{a.num_kv_heads} KV heads (query groups)"),
        (a.vocab_size % tp, f"model.tensor_parallel {tp}: does not divide the vocabulary "
                            f"({a.vocab_size})"),
        (a.dense_ffn % tp, f"model.tensor_parallel {tp}: does not divide the dense FFN width "
                           f"{a.dense_ffn}"),
        (a.num_layers % pp, f"model.pipeline_parallel {pp}: does not divide the {a.num_layers} "
                            "layers"),
        (a.num_experts % ep, f"model.expert_parallel {ep}: does not divide the {a.num_experts} "
                             "experts"),
        (a.moe_ffn % etp, f"model.expert_tensor_parallel {etp}: does not divide the expert FFN "
                          f"width {a.moe_ffn}"),
    ]
    for bad, msg in checks:
        if bad:
            raise ValueError(msg)
    if a.fam.linear_bias and etp > 1:
        raise ValueError(f"model.expert_tensor_parallel {etp}: {a.family} has expert biases, "
                         "which megatron-core 0.19 supports only at expert_tensor_parallel 1")
    if getattr(a, "mla", None) is not None:
        from trainer.megatron.family_deepseek_v3 import check_mla_layout

        check_mla_layout(tp)
    if cfg.recompute_granularity == "full" and cfg.recompute_num_layers > a.num_layers // pp:
        raise ValueError(f"model.recompute_num_layers {cfg.recompute_num_layers}: a pipeline "
                         f"stage has {a.num_layers // pp} layers")


def describe(cfg: Any, world: int) -> str:
    """The resolved layout, one line (logged at boot)."""
    dp = world // (cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel)
    edp = world // (cfg.expert_tensor_parallel * cfg.expert_parallel * cfg.pipeline_parallel)
    return (f"world {world} = TP {cfg.tensor_parallel} (SP {'on' if cfg.sequence_parallel else 'off'})"
            f" x PP {cfg.pipeline_parallel} x CP {cfg.context_parallel} x DP {dp}; experts: "
            f"ETP {cfg.expert_tensor_parallel} x EP {cfg.expert_parallel} x EDP {edp}; recompute "
            f"{cfg.recompute}")


# ---------------------------------------------------------------------- pipeline stages
def stage_layers(module: Any) -> list[int]:
    """Global (HF) layer index of each local decoder layer of this pipeline stage."""
    return [int(layer.layer_number) - 1 for layer in module.decoder.layers]


def stage_moe_layers(moe_layers: tuple[int, ...], layers: list[int]) -> tuple[int, ...]:
    """The MoE layers (HF indices) this stage runs."""
    return tuple(h for h in moe_layers if h in set(layers))


def local_positions(seq_len: int, sequence_parallel: bool) -> torch.Tensor:
    """Sequence positions (of a padded [B, S] micro-batch) this rank's routers see, in order:
    the context-parallel shard of input_ids, then its sequence-parallel slice."""
    from megatron.core import parallel_state as ps

    from trainer.samples.alignment import shard_context_parallel, shard_sequence_parallel

    pos = shard_context_parallel(torch.arange(seq_len).unsqueeze(0),
                                 ps.get_context_parallel_rank(),
                                 ps.get_context_parallel_world_size())[0]
    if ps.get_tensor_model_parallel_world_size() > 1 and sequence_parallel:
        pos = shard_sequence_parallel(pos, ps.get_tensor_model_parallel_rank(),
                                      ps.get_tensor_model_parallel_world_size())
    return pos


def model_parallel_group() -> Any | None:
    """The TP x PP group (ranks that hold slices of one model replica); None when alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


# ---------------------------------------------------------------------- weights
def model_weights(module: Any) -> dict[str, torch.Tensor]:
    """The model's weights: its parameters and the routers' `expert_bias` buffers (DeepSeek-V3's
    selection bias: a checkpoint tensor, held fixed, replicated on every rank)."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out |= {k: b for k, b in module.named_buffers() if k.endswith(".router.expert_bias")}
    return out


def _is_expert(p: torch.Tensor) -> bool:
    return not getattr(p, "allreduce", True)


def _tp_group(p: torch.Tensor) -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if _is_expert(p):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


def _glu(name: str, gated: bool) -> bool:
    return gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


def _slice(full: torch.Tensor, p: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """This rank's tensor-parallel piece of `full` (megatron's layout of parameter `p`)."""
    rank, size, _ = _tp_group(p)
    if size == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    dim = int(p.partition_dim)  # type: ignore[attr-defined]
    if _glu(name, gated):  # [gate; up]: each rank holds [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    return full.chunk(size, dim=dim)[rank]


def unslice(local: torch.Tensor, p: torch.Tensor, name: str, gated: bool) -> torch.Tensor:
    """Inverse of `_slice`: all-gather the tensor-parallel pieces (collective)."""
    import torch.distributed as dist

    rank, size, group = _tp_group(p)
    if size == 1 or not getattr(p, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    if _glu(name, gated):
        halves = [t.chunk(2, 0) for t in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim=int(p.partition_dim))  # type: ignore[attr-defined]


def unsliced_meta(p: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `unslice(p)`'s shape and dtype (no data, no collective)."""
    _, size, _ = _tp_group(p)
    shape = list(p.shape)
    if size > 1 and getattr(p, "tensor_model_parallel", False):
        shape[int(p.partition_dim)] *= size  # type: ignore[attr-defined]
    return torch.empty(shape, dtype=p.dtype, device="meta")


def stage_name(name: str, local_of: dict[int, int], pre: bool, post: bool) -> str | None:
    """Full-model name -> this stage's name (None: another stage's parameter)."""
    m = _LAYER.match(name)
    if m:
        g = int(m.group(1))
        return f"decoder.layers.{local_of[g]}.{m.group(2)}" if g in local_of else None
    if name.startswith("embedding."):
        return name if pre else None
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        return name if post else None
    return name


def shard_full(module: Any, full: dict[str, torch.Tensor], gated: bool) -> dict[str, torch.Tensor]:
    """Full megatron dict (this EP rank's experts) -> this rank's parameters (stage, TP)."""
    local_of = {g: i for i, g in enumerate(stage_layers(module))}
    params = model_weights(module)
    out = {}
    for name, t in full.items():
        local = stage_name(name, local_of, module.pre_process, module.post_process)
        if local is None:
            continue
        out[local] = _slice(t, params[local], local, gated) if local in params else t
    return out


def gather_full(module: Any, gated: bool) -> dict[str, torch.Tensor]:
    """This rank's parameters -> the full megatron dict (every stage, TP gathered; experts still
    EP-local). Collective over TP, expert-TP and PP groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    layers = stage_layers(module)
    mine = {}
    for name, p in model_weights(module).items():
        t = unslice(p.detach(), p, name, gated)
        m = _LAYER.match(name)
        mine[f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}" if m else name] = t
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return mine
    stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, {k: v.cpu() for k, v in mine.items()},
                           group=ps.get_pipeline_model_parallel_group())
    device = next(iter(mine.values())).device
    return {k: v.to(device) for s in stages for k, v in s.items()}
