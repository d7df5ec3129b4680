"""Build a megatron-core GPTModel (MoE, local spec, routing replay on) from an HF checkpoint.

Owns process-group setup for one trainer rank (gloo on CPU with the CPU shims, NCCL on GPUs)
and the model build: config from the HF config, weights through `hf_mapping`, and the check
that the model's MoE layers match the architecture the routing layer map was built from.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from services.common import families
from trainer.megatron.config import ModelConfig
from trainer.megatron.families import config_overrides
from trainer.megatron.family_deepseek_v3 import mla_config_kwargs
from trainer.megatron.grouped_experts import to_layout_of
from trainer.megatron.grouped_router import freeze_expert_bias
from trainer.megatron.hf_mapping import (
    GLOBAL_NAMES,
    GLOBAL_UNIT,
    MoeArch,
    load_arch,
    unit_to_megatron,
)
from trainer.megatron.lazy_checkpoint import LazyCheckpoint
from trainer.megatron.parallel import (
    check_layout,
    describe,
    model_weights,
    shard_full,
    stage_layers,
    stage_moe_layers,
    stage_name,
)
from trainer.megatron.spec import decoder_spec

log = logging.getLogger(__name__)


def resolve_router_dtype(cfg: ModelConfig, family: str) -> ModelConfig:
    """`cfg` with `router_dtype: auto` replaced by the engine's choice for `family` (logged)."""
    if cfg.router_dtype != "auto":
        return cfg
    fam = families.find(family)  # what the rollout engine computes router logits in
    if fam is None:
        raise ValueError(f"model.router_dtype: auto knows no engine default for model_type "
                         f"{family!r}; set fp32 or native")
    dtype, why = fam.engine_router_dtype
    log.info("model.router_dtype: auto -> %s (%s)", dtype, why)
    return cfg.model_copy(update={"router_dtype": dtype})


@dataclass
class BuiltModel:
    """A megatron GPTModel with the handles the trainer needs."""

    module: Any  # megatron GPTModel
    arch: MoeArch
    config: Any  # megatron TransformerConfig
    routers: list  # TopKRouter modules of this pipeline stage, in MoE layer order
    replays: list  # their RouterReplay instances, same order
    moe_layers: tuple[int, ...] = ()  # HF index of each of `routers`' layers (this stage's)


def init_parallel(cfg: ModelConfig) -> None:
    """Init torch.distributed (from RANK/WORLD_SIZE env or a 1-rank world) and megatron groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from services.common.cpu_features import request_amx_permission
    from trainer.megatron.cpu_shims import apply_cpu_shims

    request_amx_permission()  # bf16 CPU kernels may use AMX (no-op without it)
    on_cpu = apply_cpu_shims()
    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        # A launcher that set MASTER_* (Ray ranks: rank 0's node) rendezvous there; a lone
        # in-process rank uses an in-process store: no port, no MASTER_* for children.
        backend = "gloo" if on_cpu else "nccl"
        if world > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    check_layout(cfg, world)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            context_parallel_size=cfg.context_parallel,
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=cfg.expert_tensor_parallel)
    else:
        _check_groups(cfg)
    log.info("parallel layout: %s", describe(cfg, world))
    model_parallel_cuda_manual_seed(cfg.seed)


def _check_groups(cfg: ModelConfig) -> None:
    """Process groups built earlier in this process must be the layout `cfg` asks for."""
    from megatron.core import parallel_state as ps

    have = {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size()}
    for name, size in have.items():
        if getattr(cfg, name) != size:
            raise ValueError(f"model.{name}: process groups already built with {size}")


def transformer_config(a: MoeArch, cfg: ModelConfig):
    """The megatron TransformerConfig equivalent to the HF architecture `a`."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    cfg = resolve_router_dtype(cfg, a.family)
    bf16 = cfg.dtype == "bf16"
    tcfg = (MLATransformerConfig if a.mla else TransformerConfig)(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_heads,
        num_query_groups=a.num_kv_heads, kv_channels=a.head_dim, ffn_hidden_size=a.dense_ffn,
        num_moe_experts=a.num_experts, moe_router_topk=a.top_k, moe_ffn_hidden_size=a.moe_ffn,
        moe_layer_freq=a.moe_layer_freq, qk_layernorm=True, normalization="RMSNorm",
        layernorm_epsilon=a.rms_eps, add_bias_linear=False, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        # HF norm_topk_prob=True == softmax over the top-k logits (megatron's non-pre-softmax)
        moe_router_pre_softmax=not a.norm_topk_prob, moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if cfg.aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.aux_loss_coeff, moe_token_dispatcher_type=cfg.dispatcher,
        # replay is silently ignored by the fused router and by sinkhorn: never enable them
        moe_enable_routing_replay=True, moe_router_fusion=False,
        moe_router_dtype="fp32" if cfg.router_dtype == "fp32" else None,
        tensor_model_parallel_size=cfg.tensor_parallel, sequence_parallel=cfg.sequence_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        context_parallel_size=cfg.context_parallel,
        expert_model_parallel_size=cfg.expert_parallel,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel,
        # micro-batches are padded to their own length: pipeline stages exchange shapes
        variable_seq_lengths=cfg.pipeline_parallel > 1, use_cpu_initialization=True,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, **cfg.recompute_kwargs())
    # the family's router, QK-norm, QKV bias and shared expert (trainer.megatron.families)
    tcfg = replace(tcfg, **config_overrides(a.fam))
    r = a.rope_scaling
    if a.mla:  # MLA's own fields: sizes, rope and YaRN (trainer.megatron.family_deepseek_v3)
        return replace(tcfg, **mla_config_kwargs(a.mla, r, a.rope_theta))
    if r.type == "yarn":
        # megatron-core 0.19: GPTModel(position_embedding_type="yarn") and every attention
        # layer (the mscale on q and k) read these off the config with getattr; TransformerConfig
        # has no fields for them outside MLA.
        for key, value in {"rotary_scaling_factor": r.factor,
                           "original_max_position_embeddings": r.original_max_positions,
                           "beta_fast": r.beta_fast, "beta_slow": r.beta_slow,
                           "mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim,
                           "correction_range_round_to_int": r.truncate}.items():
            setattr(tcfg, f"yarn_{key}", value)
    return tcfg


def rope_kwargs(a: MoeArch) -> dict[str, Any]:
    """GPTModel's RoPE arguments for the HF config's RoPE (scaling included)."""
    r = a.rope_scaling
    kw: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": a.rope_theta,
                          "rotary_percent": a.rotary_percent}
    if a.mla:  # MLA builds its own rope (GPTModel skips "rope" under multi_latent_attention)
        return kw
    if r.type == "linear":  # positions / factor == HF's inv_freq / factor
        kw["seq_len_interpolation_factor"] = r.factor
    elif r.type == "llama3":
        kw |= {"rope_scaling": True, "rope_scaling_factor": r.factor}
    elif r.type == "yarn":
        kw["position_embedding_type"] = "yarn"
    return kw


def _routers(module: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def check_layer_map(built: BuiltModel) -> None:
    """The model's MoE layers must be exactly the HF config's MoE layers of this pipeline stage
    (routing map basis)."""
    layers = stage_layers(built.module)
    found = tuple(g for g, layer in zip(layers, built.module.decoder.layers, strict=True)
                  if hasattr(layer.mlp, "router"))
    if found != built.moe_layers:
        raise ValueError(f"moe_layers: model has MoE at {found}, HF config says "
                         f"{built.moe_layers} for layers {layers[0]}..{layers[-1]}")
    if any(r.router_replay is None for r in built.routers):
        raise ValueError("moe_enable_routing_replay: a router has no RouterReplay instance")
    if built.config.moe_router_fusion or any(r.routing_type == "sinkhorn" for r in built.routers):
        raise ValueError("moe_router_fusion/sinkhorn: replay would be silently ignored")


def build_model(hf_dir: str | Path, cfg: ModelConfig, load_weights: bool = True) -> BuiltModel:
    """Build the GPTModel for the checkpoint in `hf_dir` (process groups must be initialized)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from trainer.megatron.batch_first_logits import BatchFirstGPTModel

    arch = load_arch(hf_dir)
    cfg = cfg.fast_path(torch.cuda.is_available(), arch.family)  # `auto` left by a direct caller
    tcfg = transformer_config(arch, cfg)
    # The replay instance list is class-level: each model must own exactly its routers.
    RouterReplay.clear_global_router_replay_instances()
    spec = decoder_spec(tcfg, arch.fam, cfg.experts, cfg.attention, cfg.planned_dispatch is True,
                        cfg.moe_permute == "gather")
    # model.batch_first_logits: no [S, B, V] -> [B, S, V] copy of the logits
    model_cls = BatchFirstGPTModel if cfg.batch_first_logits is True else GPTModel
    # parallel_output=False: the logits are gathered over TP (the loss is computed on [B, S, V])
    module = model_cls(config=tcfg, transformer_layer_spec=spec, vocab_size=arch.vocab_size,
                       max_sequence_length=arch.max_positions,
                       pre_process=ps.is_pipeline_first_stage(),
                       post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                       share_embeddings_and_output_weights=False, **rope_kwargs(arch))
    if cfg.dtype == "bf16":
        # What megatron's Float16Module does to the weights: norms too (the local spec builds
        # them in fp32), so every layer runs in bf16 like the rollout engine's bf16 weights.
        module = module.bfloat16()
    if torch.cuda.is_available():
        module = module.cuda()
    routers = _routers(module)
    freeze_expert_bias(routers)  # a checkpoint constant in RL (trainer.megatron.grouped_router)
    built = BuiltModel(module, arch, tcfg, routers, [r.router_replay for r in routers],
                       stage_moe_layers(arch.moe_layers, stage_layers(module)))
    check_layer_map(built)
    if load_weights:
        load_hf_weights(built, hf_dir)
    return built


def load_hf_weights(built: BuiltModel, hf_dir: str | Path) -> LazyCheckpoint:
    """Copy the HF safetensors weights into the model (this rank's experts, pipeline stage and
    tensor-parallel slices); exact names. The checkpoint is read lazily, one export unit
    (decoder layer) at a time, only the tensors this rank maps; returns the reader (its
    `bytes_read`)."""
    from megatron.core import parallel_state as ps

    ckpt = LazyCheckpoint(hf_dir)
    module, arch, gated = built.module, built.arch, built.config.gated_linear_unit
    ep = (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
    local_of = {g: i for i, g in enumerate(stage_layers(module))}
    needed = {m for m in GLOBAL_NAMES if stage_name(m, local_of, module.pre_process,
                                                     module.post_process) is not None}
    params, loaded = model_weights(module), set()
    for unit in [GLOBAL_UNIT, *local_of]:
        mapped = unit_to_megatron(ckpt, arch, unit, *ep, wanted=needed)
        shard = shard_full(module, mapped, gated)
        loaded |= copy_some(params, shard)
        del mapped, shard
    if set(params) - loaded:
        raise ValueError(f"weights: missing {sorted(set(params) - loaded)[:4]}")
    return ckpt


def copy_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` into `module`'s weights (parallel.model_weights); every weight must be
    covered, no extras."""
    params = model_weights(module)
    tensors = to_layout_of(tensors, set(params))
    missing = set(params) - set(tensors)
    if missing:
        raise ValueError(f"weights: missing {sorted(missing)[:4]}")
    copy_some(params, tensors)


def copy_some(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy `tensors` into the weights `params` of the same names (no extras); returns the
    names copied. r3flow's expert names are SequentialMLP's (HF mapping, old checkpoints):
    restacked where the model groups its experts."""
    tensors = to_layout_of(tensors, set(params))
    extra = set(tensors) - set(params)
    if extra:
        raise ValueError(f"weights: unexpected {sorted(extra)[:4]}")
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"weights.{name}: shape {tuple(t.shape)}, "
                                 f"model has {tuple(p.shape)}")
            if name.endswith(".expert_bias"):  # megatron keeps it fp32 in a bf16 model
                p.data = t.to(p.device, torch.float32).clone()
            else:
                p.copy_(t)
    return set(tensors)
