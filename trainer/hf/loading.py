"""Build an HF causal LM on the meta device and read only this rank's FSDP2 shards from the
checkpoint (`hf.meta_init`): no rank holds the full model in host or device memory.

Checkpoint names differ from the model's where transformers converts at load time (e.g. one
tensor per expert -> a fused 3-D experts tensor). The inverse of that conversion is found
without knowing it: `revert_weight_conversion` (what save_pretrained applies) is run on an
index tensor (element i holds i), so each checkpoint tensor says which model elements it fills.
A parameter the conversion leaves alone (same name, same shape) is read as a row slice; a
converted one reads each source tensor whole, one at a time, and keeps the elements of this
rank's rows. FSDP2 shards dim 0 (torch.chunk), so a rank's shard is one flat range.

The index walk costs seconds per tensor at real widths (a fused experts tensor of Qwen3-30B-A3B
holds 400 M elements), and every layer repeats it: when each source fills one contiguous range
of the rank's shard (what fused experts give), that layout is kept (`Block`s in `Plans`) and
reused for every tensor whose name differs only in its numbers (the layer), with the same shape
and rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard


class SafetensorsReader:
    """Tensors of an HF checkpoint directory by name (model.safetensors or an index)."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: root / f for k, f in files.items()}
        else:
            with safe_open(str(root / "model.safetensors"), "pt") as f:
                self.file_of = {k: root / "model.safetensors" for k in f.keys()}  # noqa: SIM118
        self._open: dict[Path, Any] = {}  # file -> its safe_open handle (memory-mapped)

    def rows(self, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Rows [start, end) of tensor `name` (the whole tensor by default)."""
        if name not in self.file_of:
            raise KeyError(f"hf.meta_init: {name} is not in the checkpoint (set hf.meta_init: "
                           "false to load it with from_pretrained)")
        path = self.file_of[name]
        if path not in self._open:  # one open per file, not per tensor (256 per fused tensor)
            self._open[path] = safe_open(str(path), "pt")
        sl = self._open[path].get_slice(name)
        return sl[start:end] if start is not None else sl[:]


def build_meta(model_dir: str | Path, attn_implementation: str) -> Any:
    """The model of `model_dir`'s config with every parameter and buffer on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                attn_implementation=attn_implementation)


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of dim 0 that this rank holds of `t` (all rows unless a Shard(0) DTensor)."""
    n = t.shape[0] if t.dim() else 1
    if not isinstance(t, DTensor):
        return 0, n
    start, end = 0, n
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, f"FSDP2 shards dim 0, not {placement}"
            size = end - start
            chunk = -(-size // t.device_mesh.size(dim))
            start = min(start + t.device_mesh.get_local_rank(dim) * chunk, end)
            end = min(start + chunk, end)
    return start, end


def _sources(model: Any, key: str, shape: torch.Size, device: str = "cpu"
             ) -> dict[str, torch.Tensor]:
    """Checkpoint name -> index tensor (model element numbers) of model tensor `key`; on the
    meta device only the names and shapes (no index is built)."""
    from transformers.core_model_loading import revert_weight_conversion

    n = shape.numel()
    dtype = torch.int32 if n < 2**31 else torch.int64
    idx = torch.empty(shape, dtype=dtype, device="meta") if device == "meta" else \
        torch.arange(n, dtype=dtype).reshape(shape)
    return revert_weight_conversion(model, {key: idx})


_LAYER_PREFIX = re.compile(r"^(.*\.\d+\.)")  # "model.layers.5." of a layer's tensor name
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")  # layer (and expert) numbers in a tensor name


@dataclass(frozen=True)
class Block:
    """Source elements [src_lo, src_hi) fill the rank's flat shard from `dst` on."""

    suffix: str  # the source's name after the layer prefix
    src_lo: int
    src_hi: int
    dst: int


@dataclass
class Plans:
    """Contiguous source layouts of converted tensors, by (name with its numbers masked, shape,
    the rank's rows); None where a layout is not contiguous (walked every time)."""

    known: dict[tuple, list[Block] | None] = field(default_factory=dict)
    direct: set[tuple] = field(default_factory=set)  # not converted: read as a row slice
    walks: int = 0  # index walks done (the rest came from `known` and `direct`)


def _layer_prefix(key: str) -> str:
    """The name up to its last number ("model.layers.5."): sources are named from it on."""
    m = _LAYER_PREFIX.match(key)
    return m.group(1) if m else ""


def _blocks(prefix: str, sources: dict[str, torch.Tensor], lo: int, hi: int
            ) -> list[Block] | None:
    """Each source's kept elements as one contiguous run into [lo, hi), or None."""
    blocks = []
    for name, ix in sources.items():
        flat = ix.reshape(-1)
        pos = torch.nonzero((flat >= lo) & (flat < hi)).reshape(-1)
        if not pos.numel():
            continue
        a, n = int(pos[0]), pos.numel()
        run = flat[a:a + n]
        if not name.startswith(prefix) or int(pos[-1]) != a + n - 1 or not torch.equal(
                run, torch.arange(int(run[0]), int(run[0]) + n, dtype=run.dtype)):
            return None
        blocks.append(Block(name[len(prefix):], a, a + n, int(run[0]) - lo))
    return blocks


def read_local(model: Any, reader: SafetensorsReader, key: str, t: torch.Tensor,
               plans: Plans | None = None) -> torch.Tensor:
    """This rank's rows of model tensor `key` (global shape of `t`) from the checkpoint, fp32
    or the tensor's own dtype when not floating; `plans` keeps layouts for the next layers."""
    shape, (start, end) = t.shape, local_rows(t)
    plans = plans if plans is not None else Plans()
    prefix = _layer_prefix(key)
    plan_key = (_NUMBER.sub("#", key), tuple(shape), start, end)
    if plan_key in plans.direct:
        return reader.rows(key, start, end) if shape else reader.rows(key)
    row = shape[1:].numel()
    lo, hi = start * row, end * row
    out = torch.empty((hi - lo,), dtype=t.dtype)
    blocks = plans.known.get(plan_key)
    if blocks is None:
        names = _sources(model, key, shape, "meta")
        if list(names) == [key] and names[key].shape == shape:
            plans.direct.add(plan_key)
            return reader.rows(key, start, end) if shape else reader.rows(key)
        sources = _sources(model, key, shape)
        plans.walks += 1
        blocks = _blocks(prefix, sources, lo, hi)
        plans.known.setdefault(plan_key, blocks)
        if blocks is None:
            _walk(reader, sources, lo, hi, out)
            return out.reshape((end - start, *shape[1:]))
    for b in blocks:
        src = reader.rows(prefix + b.suffix).reshape(-1)
        out[b.dst:b.dst + b.src_hi - b.src_lo] = src[b.src_lo:b.src_hi].to(out.dtype)
    return out.reshape((end - start, *shape[1:]))


def _walk(reader: SafetensorsReader, sources: dict[str, torch.Tensor], lo: int, hi: int,
          out: torch.Tensor) -> None:
    """Any layout: each source read whole, its elements in [lo, hi) scattered into `out`."""
    for name, ix in sources.items():
        flat_ix = ix.reshape(-1)
        keep = (flat_ix >= lo) & (flat_ix < hi)
        if bool(keep.any()):
            src = reader.rows(name).reshape(-1)
            out[(flat_ix[keep] - lo).long()] = src[keep].to(out.dtype)


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, persistent) of every parameter and buffer (tied ones once)."""
    for name, p in model.named_parameters():
        yield name, p, True
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            yield full, b, b_name not in mod._non_persistent_buffers_set


def materialise(model: Any, model_dir: str | Path, device: torch.device) -> list[str]:
    """Allocate the meta model on `device` and fill this rank's shards from the checkpoint;
    returns the non-persistent buffers left for the caller to recompute (not in checkpoints)."""
    model.to_empty(device=device)
    reader, derived, plans = SafetensorsReader(model_dir), [], Plans()
    with torch.no_grad():
        for name, t, persistent in _tensors(model):
            if not persistent:
                derived.append(name)
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            local.copy_(read_local(model, reader, name, t, plans).to(local.dtype))
    return derived
