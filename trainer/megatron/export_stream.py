"""The megatron HF export as a stream to one rank (the weight push's sender): no rank ever holds
the whole model.

The model is cut into export units: `GLOBAL_UNIT` (embedding, final norm, output layer), then
every decoder layer. Every rank walks the units in the same order; the ranks of the pipeline stage
that holds a unit map it to HF names (tensor-parallel pieces all-gathered inside the stage, this
rank's experts under their global ids: trainer.megatron.hf_mapping.unit_to_hf). Each HF tensor
has one provider, the lowest rank that holds it (an expert: its EP owner; the rest of a unit: its
stage's first rank). A provider packs what it provides of a unit into flat chunks of at most
`chunk_bytes` and sends them point-to-point to the sender, which yields views into the chunks it
received (its own tensors as they are, no copy).

Memory: a non-sender rank holds one unit's mapped tensors (views of its parameters when TP is 1)
plus `depth` chunks in flight; the sender `depth` received chunks plus what its consumer keeps.
The layout (each rank's HF names, shapes and dtypes per unit) is worked out once on meta tensors
and exchanged with one all_gather_object; both ends cut the same chunks from it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.megatron.hf_mapping import GLOBAL_UNIT, MoeArch, unit_to_hf
from trainer.megatron.parallel import model_weights, stage_layers, unslice, unsliced_meta

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_ALIGN = 64
# (megatron name in the model, full-model megatron name, parameter)
_Param = tuple[str, str, torch.Tensor]


@dataclass(frozen=True)
class Entry:
    """One HF tensor in a chunk."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """Tensors of one unit that rank `src` provides, sent (unless src is the sender) as one flat
    buffer of `nbytes`."""

    src: int
    entries: tuple[Entry, ...]
    nbytes: int

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape)
                for e in self.entries]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def cut_chunks(src: int, rows: list[tuple[str, tuple[int, ...], torch.dtype]],
               chunk_bytes: int) -> list[Chunk]:
    """`rows` (name, shape, dtype) of one provider, in order, cut into chunks of at most
    `chunk_bytes` (a larger tensor gets a chunk of its own)."""
    out: list[Chunk] = []
    entries: list[Entry] = []
    pos = 0
    for name, shape, dtype in rows:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if entries and _aligned(pos) + nbytes > chunk_bytes:
            out.append(Chunk(src, tuple(entries), pos))
            entries, pos = [], 0
        offset = _aligned(pos)
        entries.append(Entry(name, shape, dtype, offset, nbytes))
        pos = offset + nbytes
    if entries:
        out.append(Chunk(src, tuple(entries), pos))
    return out


class HFStream:
    """The streamed export (a collective: every rank of the default group iterates it, once per
    export; the layout is worked out once, at construction)."""

    def __init__(self, module: Any, arch: MoeArch, gated: bool, *, sender: int = 0,
                 chunk_bytes: int = 256 << 20, depth: int = 2) -> None:
        from megatron.core import parallel_state as ps

        self.arch, self.gated, self.sender, self.depth = arch, gated, sender, depth
        self.rank = dist.get_rank()
        self.ep = (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
        self.units = _units(module)
        self.order, self.chunks = self._layout(chunk_bytes)
        self.device = next(iter(model_weights(module).values())).device
        self.peak_inflight = 0  # most chunk bytes this rank allocated at once (tests, benches)
        self._inflight: deque[tuple[Any, torch.Tensor]] = deque()
        self._recv_stream: torch.cuda.Stream | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) in unit order on the sender; nothing on other ranks."""
        for unit in self.order:
            local = self._unit_hf(unit, meta=False) if unit in self.units else {}
            for chunk in self.chunks[unit]:
                if chunk.src == self.sender == self.rank:
                    yield from ((e.name, local[e.name]) for e in chunk.entries)
                elif chunk.src == self.rank:
                    self._send(chunk, local)
                elif self.rank == self.sender:
                    yield from zip((e.name for e in chunk.entries), self._recv(chunk),
                                   strict=True)
            del local
        self._retire(0)

    def _unit_hf(self, unit: int, meta: bool) -> dict[str, torch.Tensor]:
        """This rank's HF tensors of `unit` (a collective over its TP/ETP groups unless meta)."""
        sd = {full: unsliced_meta(p) if meta else unslice(p.detach(), p, name, self.gated)
              for name, full, p in self.units[unit]}
        return unit_to_hf(sd, self.arch, unit, *self.ep)

    def _layout(self, chunk_bytes: int) -> tuple[list[int], dict[int, list[Chunk]]]:
        """The unit order and every unit's chunks, the same on every rank."""
        mine = {u: [(n, tuple(t.shape), t.dtype) for n, t in self._unit_hf(u, True).items()]
                for u in self.units}
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

    def _send(self, chunk: Chunk, local: dict[str, torch.Tensor]) -> None:
        buf = self._alloc(chunk)
        with torch.no_grad():
            torch._foreach_copy_(chunk.views(buf), [local[e.name] for e in chunk.entries])
        work = dist.isend(buf, dst=self.sender)
        assert work is not None  # this rank is in the default group
        self._inflight.append((work, buf))
        self._retire(self.depth)

    def _recv(self, chunk: Chunk) -> list[torch.Tensor]:
        """Post the chunk's receive; its views are valid on the current stream. On CUDA the
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
        return chunk.views(buf)

    def _alloc(self, chunk: Chunk) -> torch.Tensor:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
        held = sum(b.numel() for _, b in self._inflight) + buf.numel()
        self.peak_inflight = max(self.peak_inflight, held)
        return buf

    def _retire(self, keep: int) -> None:
        """Wait for the oldest chunks until `keep` are in flight. On CUDA the host waits too:
        a freed chunk is reused only once the stream is past it, so running ahead would
        allocate without bound."""
        while len(self._inflight) > keep:
            handle, buf = self._inflight.popleft()
            if isinstance(handle, torch.cuda.Event):  # a receive: that receive only
                handle.synchronize()
                continue
            if handle is not None:
                handle.wait()
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()


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
