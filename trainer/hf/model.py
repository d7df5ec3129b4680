"""Load an HF MoE causal LM for training, and shard it with FSDP2 (`fully_shard`).

Process groups: as the megatron backend, RANK/WORLD_SIZE/MASTER_* from the environment (a 1-rank
world when unset), gloo on CPU and NCCL on GPUs. FSDP2 with gloo on CPU works in torch 2.13
(checked: all-gather, reduce-scatter, DTensor grad-norm clipping). Each decoder layer is one FSDP
unit plus the root; routers sit inside their layer's unit, so their hooks see full weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.common import families

log = logging.getLogger(__name__)


def init_process_group() -> tuple[int, int]:
    """(rank, world size); initialises torch.distributed from the environment if needed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "nccl" if gpu else "gloo"
        if world > 1:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
        else:  # one rank: an in-process store, no port, no MASTER_* for children to inherit
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _reset_rotary_buffers(model: torch.nn.Module) -> None:
    """Recompute non-persistent RoPE buffers: transformers 5 may leave them uninitialised when
    the model is loaded while a process group exists (seen with 5.24; they are not in the
    checkpoint)."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "inv_freq"):
            fresh = type(mod)(mod.config)
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(mod, name):
                    getattr(mod, name).copy_(getattr(fresh, name))


def load_model(model_dir: str | Path, attn_implementation: str = "sdpa") -> Any:
    """The HF causal LM in `model_dir`, fp32 parameters (bf16 compute comes from FSDP2)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attn_implementation)
    with torch.no_grad():
        _reset_rotary_buffers(model)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def check_packing(model: Any, packing: bool) -> None:
    """ValueError when `hf.packing` is on for a family whose transformers 5.24 masks do not turn
    restarting position ids into a block-diagonal mask (services.common.families: `hf_packing`
    false): packed samples would attend to each other (GPT-OSS, sinks + sliding windows: |logit|
    differs by 4.5 packed vs separate on the tiny model, eager attention; Mixtral/Qwen: 2e-6)."""
    family = getattr(model.config, "model_type", "")
    fam = families.find(family)
    if packing and fam is not None and not fam.hf_packing:
        raise ValueError(f"hf.packing: transformers does not isolate packed samples for "
                         f"{family} (its attention masks ignore restarting position ids); "
                         "set hf.packing: false")


def device_mesh(shape: tuple[int, ...]) -> Any:
    """FSDP2's mesh over the world: (shard,) or, for hybrid sharding, (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", shape,
                            mesh_dim_names=names)


def shard(model: torch.nn.Module, layers, bf16: bool, reshard_after_forward: bool,
          mesh: Any = None) -> None:
    """FSDP2 in place: every decoder layer, then the root; bf16 compute with fp32 grads. A 2-D
    `mesh` (replicate, shard) is HSDP: sharded within a group, replicated across groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def fill_derived_buffers(model: torch.nn.Module, names: list[str]) -> None:
    """Recompute the non-persistent buffers `materialise` left empty (RoPE frequencies); any
    other is refused by name (its value is in no checkpoint)."""
    rotary = {f"{n}.{b}" for n, m in model.named_modules()
              if type(m).__name__.endswith("RotaryEmbedding")
              for b in ("inv_freq", "original_inv_freq")}
    unknown = [n for n in names if n not in rotary]
    if unknown:
        raise ValueError(f"hf.meta_init: non-persistent buffers {unknown} cannot be read from the "
                         "checkpoint; set hf.meta_init: false")
    with torch.no_grad():
        _reset_rotary_buffers(model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers as full tensors (collective under FSDP2)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = v.detach().float().cpu().clone() if v.is_floating_point() else v.cpu().clone()
    return out


def export_hf(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint-named weights (what save_pretrained writes: transformers' reverse of its
    load-time conversions, e.g. fused 3-D experts back to one tensor per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(model, full_state_dict(model))
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def iter_export_hf(model: Any, dtype: torch.dtype, sender: int = 0
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`export_hf` as a stream to rank `sender` (a collective under FSDP2: every rank iterates
    it to the end): one parameter gathered at a time, to the sender only (`gather_to`), and
    reverted to checkpoint names on its own, so no rank holds the whole model and no rank but
    the sender holds even one whole parameter."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import revert_weight_conversion

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for key, value in model.state_dict().items():
        full = gather_to(value, sender, rank) if isinstance(value, DTensor) else value
        if rank != sender or full is None:
            continue
        for name, t in revert_weight_conversion(model, {key: full.detach()}).items():
            yield name, t.to(dtype) if t.is_floating_point() else t


def gather_to(value: Any, sender: int, rank: int) -> torch.Tensor | None:
    """A DTensor's full value on global rank `sender` (None on the others): its dim-0 shards
    gathered over the shard dimension's group by the ranks of the sender's replica (HSDP: the
    other replicas send nothing). Layouts other than one Shard(0) plus Replicate dims fall back
    to `full_tensor()` (an all-gather to every rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = value.device_mesh, value.placements
    shard = [d for d, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if len(shard) != 1 or not all(isinstance(p, Shard | Replicate) for p in placements):
        full = value.full_tensor()
        return full if rank == sender else None
    d = shard[0]
    mine, theirs = mesh.get_coordinate(), (mesh.mesh == sender).nonzero()[0].tolist()
    if any(mine[i] != theirs[i] for i in range(mesh.ndim) if i != d):
        return None  # another replica: the sender's own replica gathers
    local, rows, world = value.to_local(), value.shape[0], mesh.size(d)
    chunk = -(-rows // world)  # torch.chunk's split: equal chunks, the last ones short or empty
    padded = local.new_zeros((chunk, *value.shape[1:]))
    padded[:local.shape[0]] = local
    if rank != sender:
        dist.gather(padded, None, dst=sender, group=mesh.get_group(d))
        return None
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.gather(padded, parts, dst=sender, group=mesh.get_group(d))
    return torch.cat(parts)[:rows]
