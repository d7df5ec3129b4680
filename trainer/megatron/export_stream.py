"""The megatron HF export as a stream to one rank (the weight push's sender): no rank ever holds
the whole model.

The model is cut into export units: `GLOBAL_UNIT` (embedding, final norm, output layer), then
every decoder layer. Every rank walks the units in the same order; the ranks of the pipeline stage
that holds a unit map it to HF names (tensor-parallel pieces all-gathered inside the stage, this
rank's experts under their global ids: trainer.megatron.hf_mapping.unit_to_hf). Each HF tensor
has one provider, the lowest rank that holds it (an expert: its EP owner; the rest of a unit: its
stage's first rank). A provider packs what it provides of a unit into flat chunks of at most
`chunk_bytes` and sends them point-to-point to the sender, which yields views into the chunks it
received (its own tensors as they are, no copy) or, for the weight push (`packed()`), every chunk
whole as a wire bucket: the push then does no work per tensor, only per chunk.

Memory: a non-sender rank holds one unit's mapped tensors (views of its parameters when TP is 1)
plus `depth` chunks in flight; the sender `depth` received chunks plus what its consumer keeps.
The layout (each rank's HF names, shapes and dtypes per unit) is worked out once on meta tensors
and exchanged with one all_gather_object; both ends cut the same chunks from it.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.common.weight_sync import buckets as bk
from trainer.megatron.hf_mapping import GLOBAL_UNIT, MoeArch, unit_to_hf
from trainer.megatron.parallel import model_weights, stage_layers, unslice, unsliced_meta

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"\.mlp\.experts\.")  # a routed expert's parameter (not shared experts)
# (megatron name in the model, full-model megatron name, parameter)
_Param = tuple[str, str, torch.Tensor]


@dataclass(frozen=True)
class Chunk:
    """Tensors of one unit that rank `src` provides, sent (unless src is the sender) as one flat
    buffer of `nbytes` (whole ALIGN rows: a chunk is also a wire bucket, bk.PackedBucket)."""

    src: int
    entries: tuple[bk.TensorEntry, ...]
    nbytes: int

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return bk.bucket_views(buf, list(self.entries))


def cut_chunks(src: int, rows: list[tuple[str, tuple[int, ...], torch.dtype]],
               chunk_bytes: int) -> list[Chunk]:
    """`rows` (name, shape, dtype) of one provider, in order, cut into chunks of at most
    `chunk_bytes` (a larger tensor gets a chunk of its own)."""
    out: list[Chunk] = []
    entries: list[bk.TensorEntry] = []
    pos = 0
    for name, shape, dtype in rows:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if entries and bk.aligned(pos) + nbytes > chunk_bytes:
            out.append(Chunk(src, tuple(entries), bk.aligned(pos)))
            entries, pos = [], 0
        offset = bk.aligned(pos)
        entries.append(bk.TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        pos = offset + nbytes
    if entries:
        out.append(Chunk(src, tuple(entries), bk.aligned(pos)))
    return out


class HFStream:
    """The streamed export (a collective: every rank of the default group iterates it, once per
    export; the layout is worked out once, at construction). `wire`: floating tensors travel
    in that dtype (None: as they are)."""

    def __init__(self, module: Any, arch: MoeArch, gated: bool, *, sender: int = 0,
                 chunk_bytes: int = 256 << 20, depth: int = 2,
                 wire: torch.dtype | None = None) -> None:
        from megatron.core import parallel_state as ps

        self.arch, self.gated, self.sender, self.depth = arch, gated, sender, depth
        self.wire, self.rank = wire, dist.get_rank()
        self.ep = (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
        self.units = _units(module)
        self.order, self.chunks = self._layout(chunk_bytes)
        self.device = next(iter(model_weights(module).values())).device
        self.experts = _ExpertViews(arch)
        self.peak_inflight = 0  # most chunk bytes this rank allocated at once (tests, benches)
        self.host_wait_s = 0.0  # seconds the host waited for chunks in flight (benches)
        self._inflight: deque[tuple[Any, torch.Tensor]] = deque()
        self._recv_stream: torch.cuda.Stream | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in unit order on the sender; nothing on other ranks."""
        for chunk, local, buf in self._walk(packed=False):
            if buf is None:
                yield from ((e.name, local[e.name]) for e in chunk.entries)
            else:
                yield from zip((e.name for e in chunk.entries), chunk.views(buf), strict=True)

    def packed(self) -> Iterator[bk.PackedBucket]:
        """Every chunk as a wire bucket on the sender (its own tensors packed here, the others'
        as received: no tensor-by-tensor hand-off); nothing on other ranks."""
        for chunk, _, buf in self._walk(packed=True):
            assert buf is not None
            yield bk.PackedBucket(chunk.entries, buf)

    def _walk(self, packed: bool) -> Iterator[tuple[Chunk, dict[str, torch.Tensor],
                                                    torch.Tensor | None]]:
        """The sender's chunks in order: (chunk, its own tensors, None) for a chunk of its own
        unless `packed`, else (chunk, {}, the flat buffer). Other ranks send theirs."""
        for unit in self.order:
            local = self._unit_hf(unit) if unit in self.units else {}
            for chunk in self.chunks[unit]:
                if chunk.src == self.sender == self.rank:
                    yield (chunk, {}, self._pack(chunk, local)) if packed else \
                        (chunk, local, None)
                elif chunk.src == self.rank:
                    self._send(chunk, local)
                elif self.rank == self.sender:
                    yield chunk, {}, self._recv(chunk)
            del local
        self._retire(0)

    def _unit_hf(self, unit: int) -> dict[str, torch.Tensor]:
        """This rank's HF tensors of `unit` (a collective over its TP/ETP groups). The routed
        experts' tensors are views of the parameters where no TP gather applies: mapped once
        and reused while the parameters stay where they were (_ExpertViews)."""
        params = self.units[unit]
        cached = self.experts.get(unit, params)
        if cached is not None:
            rest = [q for q in params if not _EXPERT.search(q[1])]
            return unit_to_hf(self._unsliced(rest), self.arch, unit, *self.ep,
                              experts=False) | cached
        sd = self._unsliced(params)
        if unit == GLOBAL_UNIT or not self.experts.can_cache:
            return unit_to_hf(sd, self.arch, unit, *self.ep)
        experts = unit_to_hf(sd, self.arch, unit, *self.ep, experts=True)
        self.experts.offer(unit, params, experts)
        return unit_to_hf(sd, self.arch, unit, *self.ep, experts=False) | experts

    def _unsliced(self, params: list[_Param]) -> dict[str, torch.Tensor]:
        return {full: unslice(p.detach(), p, name, self.gated) for name, full, p in params}

    def _layout(self, chunk_bytes: int) -> tuple[list[int], dict[int, list[Chunk]]]:
        """The unit order and every unit's chunks, the same on every rank."""
        mine = {u: [(n, tuple(t.shape), self._on_wire(t.dtype)) for n, t in unit_to_hf(
            {full: unsliced_meta(p) for _, full, p in params}, self.arch, u, *self.ep).items()]
            for u, params in self.units.items()}
        tables: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tables, mine)
        order = sorted({u for t in tables for u in t})
        chunks: dict[int, list[Chunk]] = {}
        for unit in order:
            seen: set[str] = set()
            chunks[unit] = []
            for src, table in enumerate(tables):
                rows = [r for r in table.get(unit, []) if r[0] not in seen]
                seen |= {r[0] for r in rows}
                chunks[unit] += cut_chunks(src, rows, chunk_bytes)
        return order, chunks

    def _on_wire(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.wire is None else bk.dtype_on_wire(dtype, self.wire)

    def _pack(self, chunk: Chunk, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """A fresh buffer holding the chunk's tensors (one multi-tensor copy)."""
        buf = self._alloc(chunk)
        with torch.no_grad():
            torch._foreach_copy_(chunk.views(buf), [local[e.name] for e in chunk.entries])
        return buf

    def _send(self, chunk: Chunk, local: dict[str, torch.Tensor]) -> None:
        buf = self._pack(chunk, local)
        work = dist.isend(buf, dst=self.sender)
        assert work is not None  # this rank is in the default group
        self._inflight.append((work, buf))
        self._retire(self.depth)

    def _recv(self, chunk: Chunk) -> torch.Tensor:
        """Post the chunk's receive; the buffer is valid on the current stream. On CUDA the
        host does not wait for it: the current stream waits on an event of a stream of its
        own (not on the current stream, which also waits for the push's broadcasts)."""
        buf = self._alloc(chunk)
        work = dist.irecv(buf, src=chunk.src)
        assert work is not None
        if buf.is_cuda:
            if self._recv_stream is None:
                self._recv_stream = torch.cuda.Stream(buf.device)
            with torch.cuda.stream(self._recv_stream):
                work.wait()
                done = torch.cuda.Event()
                done.record()
            torch.cuda.current_stream(buf.device).wait_event(done)
            self._inflight.append((done, buf))
        else:
            work.wait()
            self._inflight.append((None, buf))
        self._retire(self.depth)
        return buf

    def _alloc(self, chunk: Chunk) -> torch.Tensor:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
        held = sum(b.numel() for _, b in self._inflight) + buf.numel()
        self.peak_inflight = max(self.peak_inflight, held)
        return buf

    def _retire(self, keep: int) -> None:
        """Wait for the oldest chunks until `keep` are in flight. On CUDA the host waits too:
        a freed chunk is reused only once the stream is past it, so running ahead would
        allocate without bound."""
        t0 = time.perf_counter()
        while len(self._inflight) > keep:
            handle, buf = self._inflight.popleft()
            if isinstance(handle, torch.cuda.Event):  # a receive: that receive only
                handle.synchronize()
                continue
            if handle is not None:
                handle.wait()
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
        self.host_wait_s += time.perf_counter() - t0


def _units(module: Any) -> dict[int, list[_Param]]:
    """This rank's parameters by export unit (global layer index, or GLOBAL_UNIT)."""
    layers = stage_layers(module)
    out: dict[int, list[_Param]] = {}
    for name, p in model_weights(module).items():
        m = _LAYER.match(name)
        unit = layers[int(m.group(1))] if m else GLOBAL_UNIT
        full = f"decoder.layers.{unit}.{m.group(2)}" if m else name
        out.setdefault(unit, []).append((name, full, p))
    return out


class _ExpertViews:
    """Each unit's routed-expert HF tensors, kept while every one of them is a view of the
    unit's parameters (no expert-TP gather, no fused-expert repacking): a MoE layer's bulk
    (Qwen3-30B-A3B: 128 experts x 3 tensors) then costs no mapping work per push, which is
    what bounded the push on the host. A unit whose parameters moved (a data pointer changed)
    is mapped afresh."""

    def __init__(self, arch: MoeArch) -> None:
        self.can_cache = not arch.fam.fused_experts
        self._units: dict[int, tuple[tuple[int, ...], dict[str, torch.Tensor]]] = {}

    def get(self, unit: int, params: list[_Param]) -> dict[str, torch.Tensor] | None:
        hit = self._units.get(unit)
        if hit is not None and hit[0] != _pointers(params):
            del self._units[unit]
            return None
        return None if hit is None else hit[1]

    def offer(self, unit: int, params: list[_Param], experts: dict[str, torch.Tensor]) -> None:
        """Keep `experts` (this unit's mapped expert tensors) if each shares a parameter's
        storage (then it reads the current weights at every push)."""
        bases = {p.untyped_storage().data_ptr() for _, _, p in params}
        if experts and all(t.untyped_storage().data_ptr() in bases for t in experts.values()):
            self._units[unit] = (_pointers(params), experts)


def _pointers(params: list[_Param]) -> tuple[int, ...]:
    return tuple(p.data_ptr() for _, _, p in params)
