"""Training samples from pulled GRPO groups, and padded micro-batches for the model.

Sequence packing here is padding: each micro-batch is [B, S] with one sequence per row, right-
padded to S (the longest in the micro-batch rounded up to `pad_multiple`); samples are sorted by
length before they are cut into micro-batches so little is padded. This needs neither THD packed
sequences nor a custom attention mask (pads come after every real token, so the causal mask keeps
them out of every real token's context), which keeps the path identical on CPU and GPU.
Legend: P prompt, R response, T rows, L MoE layers, K top-k, B batch rows, S sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.common.routing_rules import RoutingRuleError, RoutingSpec, check_layout, expected_rows
from trainer.samples.alignment import (
    LayerMap,
    RoutingChunk,
    RoutingLayoutError,
    assemble_rows,
    filler_row,
    pack_routing,
    pad_last_row,
)


@dataclass
class Sample:
    """One trajectory, flattened: tokens = prompt + response."""

    tokens: np.ndarray  # [P+R] int64
    prompt_len: int
    rollout_logprobs: np.ndarray  # [R] float32, sampled-token logprobs of the generating policy
    loss_mask: np.ndarray  # [R] bool
    reward: float = 0.0
    group_id: str = ""
    advantage: float = 0.0
    routing_TLK: np.ndarray | None = None  # [P+R-1, L_moe, K] trainer MoE layers (codec dtype)
    policy_version: int = 0
    temperature: np.ndarray | None = None  # [R] sampling temperature per token (None = 1)
    trajectory_id: str = ""
    segment_lens: tuple[int, ...] = ()  # tokens per segment (() = one segment)
    truncated: bool = False  # finish reason length: hit max_tokens (DAPO overlong filtering)
    routing_encoded: EncodedRouting | None = None  # routing left encoded (decoded per micro-batch)

    def routing(self) -> np.ndarray | None:
        """[P+R-1, L_moe, K] routing in the codec's dtype: `routing_TLK` when set, else decoded
        from `routing_encoded` for this call (the caller's copy; nothing is kept)."""
        if self.routing_TLK is not None:
            return self.routing_TLK
        return None if self.routing_encoded is None else self.routing_encoded.decode()

    @property
    def has_routing(self) -> bool:
        return self.routing_TLK is not None or self.routing_encoded is not None

    def agreement_units(self) -> list[tuple[str, int, int]]:
        """(name, first row, end row) of the units routing agreement is judged on: the prompt
        rows, then each segment's rows (the rows whose outputs predict its tokens, i.e. the
        rows that segment's engine pass produced); the padded last row is left out."""
        p, end = self.prompt_len, self.tokens.size - 1
        units, row = [("prompt", 0, p - 1)], p - 1
        for j, n in enumerate(self.segment_lens or (self.tokens.size - p,)):
            units.append((f"segment {j}", row, min(row + n, end)))
            row += n
        return [u for u in units if u[2] > u[1]]


def _decode_chunk(msg, name: str, decode: Callable, num_experts: int, top_k: int | None
                  ) -> RoutingChunk:
    k = int(msg.shape[2]) if len(msg.shape) == 3 else -1
    try:  # the model's num_experts and top-k (services/common/routing_rules.py)
        check_layout(RoutingSpec(num_experts, top_k=top_k), layers=len(msg.layer_ids),
                     top_k=k, num_experts=int(msg.num_experts))
    except RoutingRuleError:
        raise RoutingLayoutError(
            f"{name}: routing has num_experts={msg.num_experts}, top_k={k}; the trainer's model "
            f"has num_experts={num_experts}, top_k={top_k} (rollout engine serving another model "
            "or another num_experts_per_tok?)") from None
    return RoutingChunk(int(msg.start_row), decode(msg, name), tuple(msg.layer_ids))


@dataclass
class EncodedRouting:
    """A trajectory's routing as it came from the store, decoded only when asked (issue 54):
    the trainer's host then holds a batch's routing encoded (~1/3 to 1/8 of its uint8) and one
    micro-batch decoded at a time (`make_microbatch`), not every sample of the step decoded.
    Pickles as its chunk messages (Megatron's model-parallel sample exchange)."""

    trajectory_id: str
    chunks: list[tuple[str, Any]]  # (name for errors, RoutingChunk message) in wire order
    rows: int  # P + R - 1
    layer_map: LayerMap
    num_experts: int
    top_k: int | None
    codec: Callable  # (RoutingChunk, name) -> ids [rows, layers, K] (wire.routing_from_proto)

    @classmethod
    def of(cls, traj, rows: int, layer_map: LayerMap, num_experts: int, top_k: int | None,
           codec: Callable) -> EncodedRouting:
        chunks = [(f"trajectory {traj.trajectory_id} segment {s.index} routing[{j}]", msg)
                  for s in traj.segments for j, msg in enumerate(s.routing)]
        return cls(traj.trajectory_id, chunks, rows, layer_map, num_experts, top_k, codec)

    def __getstate__(self) -> dict:
        """The chunk messages as their wire bytes: a protobuf message pickles under its
        descriptor's module name (r3flow.v1...), which is not importable here."""
        state = dict(self.__dict__)
        state["chunks"] = [(name, msg.SerializeToString()) for name, msg in self.chunks]
        return state

    def __setstate__(self, state: dict) -> None:
        from services.common.pb.r3flow.v1 import routing_pb2

        state["chunks"] = [(name, routing_pb2.RoutedExperts.FromString(data))
                           for name, data in state["chunks"]]
        self.__dict__.update(state)

    def decode(self) -> np.ndarray:
        """[rows, L_moe, K] in the codec's dtype: every chunk checked against the model,
        decoded, spliced and mapped to the model's MoE layers; ValueError (RoutingLayoutError,
        InvalidRoutingError, ...) naming the trajectory and chunk."""
        chunks = [_decode_chunk(msg, name, self.codec, self.num_experts, self.top_k)
                  for name, msg in self.chunks]
        if any(int(c.ids_TLK.max(initial=0)) >= self.num_experts for c in chunks):
            raise ValueError(f"trajectory {self.trajectory_id}: expert id >= {self.num_experts}")
        ids_TLK, _ = assemble_rows(chunks, self.rows, f"trajectory {self.trajectory_id} routing")
        return self.layer_map.select(ids_TLK)


class UnreproducibleSamplingError(ValueError):
    """A segment sampled in a way the trainer's logprobs cannot reproduce."""


def segment_temperature(seg, trajectory_id: str) -> float:
    """The temperature a segment was sampled at; ValueError for what the trainer cannot
    reproduce (greedy, nucleus or top-k truncation: the ratio would be of another policy)."""
    if not seg.HasField("sampling"):
        return 1.0  # workers that predate SamplingParams sampled at T = 1, untruncated
    p = seg.sampling
    name = f"trajectory {trajectory_id} segment {seg.index} sampling"
    if not p.temperature > 0:
        raise UnreproducibleSamplingError(
            f"{name}.temperature: {p.temperature:.4g} (greedy) has no sampling distribution to "
            "train a PPO ratio on")
    if p.top_p < 1 or p.top_k > 0:
        raise UnreproducibleSamplingError(
            f"{name}: top_p={p.top_p:.4g}, top_k={p.top_k}: the trainer does not model truncated "
            "sampling; roll out with top_p=1 and no top_k")
    return float(p.temperature)


def sample_from_trajectory(traj, layer_map: LayerMap | None, num_experts: int,
                           decode: Callable | None = None, top_k: int | None = None,
                           keep_encoded: bool = False) -> Sample:
    """Trajectory proto -> Sample; routing assembled and mapped when `layer_map` is given (its
    num_experts and top-k must be the model's: RoutingLayoutError otherwise). `keep_encoded`:
    the routing is decoded here only to check it, then dropped; the sample keeps the chunk
    messages (`routing_encoded`) and each micro-batch decodes its own (the trainer's intake)."""
    tokens = [int(t) for s in traj.segments for t in s.token_ids]
    logprobs = [float(x) for s in traj.segments for x in s.logprobs]
    mask = np.concatenate([np.frombuffer(s.loss_mask, np.uint8) if s.loss_mask
                           else np.ones(len(s.token_ids), np.uint8) for s in traj.segments])
    if len(logprobs) != len(tokens) or mask.size != len(tokens):
        raise ValueError(f"trajectory {traj.trajectory_id}: {len(tokens)} tokens, "
                         f"{len(logprobs)} logprobs, {mask.size} loss-mask entries")
    temps = np.concatenate([np.full(len(s.token_ids), segment_temperature(s, traj.trajectory_id),
                                    np.float32) for s in traj.segments])
    prompt = np.asarray(traj.prompt_token_ids, np.int64)
    sample = Sample(np.concatenate([prompt, np.asarray(tokens, np.int64)]), prompt.size,
                    np.asarray(logprobs, np.float32), mask.astype(bool), float(traj.reward),
                    traj.group_id,
                    policy_version=min((s.policy_version for s in traj.segments), default=0),
                    temperature=temps, trajectory_id=traj.trajectory_id,
                    segment_lens=tuple(len(s.token_ids) for s in traj.segments),
                    truncated=traj.finish_reason == trajectory_pb2.FINISH_REASON_LENGTH)
    if layer_map is not None:
        if decode is None:
            from services.common.wire import routing_from_proto
            decode = routing_from_proto
        rows = expected_rows(sample.prompt_len, sample.tokens.size - sample.prompt_len)
        enc = EncodedRouting.of(traj, rows, layer_map, num_experts, top_k, decode)
        routing_TLK = enc.decode()  # every check runs here, at intake, either way
        if keep_encoded:
            sample.routing_encoded = enc
        else:
            sample.routing_TLK = routing_TLK
    return sample


@dataclass
class MicroBatch:
    """A padded [B, S] micro-batch; position i's logits predict token i+1."""

    tokens_BS: torch.Tensor
    position_ids_BS: torch.Tensor
    labels_BS: torch.Tensor  # token at i+1 (0 past the end)
    loss_mask_BS: torch.Tensor  # float: 1 where label i+1 is a trained response token
    old_logprobs_BS: torch.Tensor  # behaviour (rollout) logprob of label i+1
    advantages_BS: torch.Tensor
    routing_BSLK: torch.Tensor | None  # padded, last row filled; codec dtype (`routed_ids`)
    valid_rows_BS: torch.Tensor  # bool: rows that carry real engine routing
    samples: list[Sample] = field(default_factory=list)
    temperature_BS: torch.Tensor | None = None  # sampling temperature of label i+1 (1 elsewhere)
    # Filled by the trainer's passes: old-policy / reference logprobs, R2-recorded routing.
    train_old_lp: torch.Tensor | None = None
    ref_lp: torch.Tensor | None = None
    replay_rows: list[torch.Tensor] | None = None  # [T, K] per MoE layer, codec dtype
    is_weight_BS: torch.Tensor | None = None  # TIS weight per token (trainer.losses.objectives)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask_BS.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        """Move the model inputs, loss tensors and rollout routing to `device`. Routing moves
        once per step here: left on the host, every replaying forward copied each layer's ids
        from pageable memory (a host sync per layer; r3 steps took 1.79x off on 4 x H100).
        Routing keeps the codec's uint8/uint16 there too (every micro-batch of a step stays
        on the device for the step: 384 B per token at 48 layers top-8, not 3 KiB of int64);
        its users widen one micro-batch at a time (`to_router_rows`, `routed_ids`)."""
        for name in ("tokens_BS", "position_ids_BS", "labels_BS", "loss_mask_BS",
                     "old_logprobs_BS", "advantages_BS", "valid_rows_BS", "temperature_BS",
                     "routing_BSLK"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        return self


def routed_ids(ids_BSLK: torch.Tensor) -> torch.Tensor:
    """A micro-batch's routing as int64, on its device: what the routing rules and routers
    take (a uint8 tensor compared with num_experts = 256 would wrap)."""
    return ids_BSLK.long()


def compact_ids(rows: Sequence[torch.Tensor], num_experts: int) -> list[torch.Tensor]:
    """Expert ids (e.g. the routers' recorded int64 top-k) in the codec's dtype, on their
    device: uint8 when num_experts <= 256, else uint16 (the same values; widened again one
    micro-batch at a time)."""
    dtype = torch.uint8 if num_experts <= 256 else torch.uint16
    return [t.to(dtype) for t in rows]


def sample_spans(mb: MicroBatch) -> list[tuple[Sample, int, int]]:
    """(sample, batch row, first position) of each sample of `mb`: one sample per row when
    padded, back to back in row 0 when packed ([1, T], trainer.hf.packing)."""
    if mb.tokens_BS.shape[0] != 1 or len(mb.samples) < 2:
        return [(s, b, 0) for b, s in enumerate(mb.samples)]
    starts = np.cumsum([0] + [s.tokens.size for s in mb.samples])[:-1]
    return [(s, 0, int(o)) for s, o in zip(mb.samples, starts, strict=True)]


def _pad_len(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def make_microbatch(samples: Sequence[Sample], pad_multiple: int = 8) -> MicroBatch:
    """Right-pad `samples` into one micro-batch."""
    b, s = len(samples), _pad_len(max(x.tokens.size for x in samples), pad_multiple)
    tokens, labels = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)
    mask, old, adv = (torch.zeros(b, s, dtype=torch.float32) for _ in range(3))
    valid = torch.zeros(b, s, dtype=torch.bool)
    temp = torch.ones(b, s, dtype=torch.float32)
    for i, x in enumerate(samples):
        n, p, r = x.tokens.size, x.prompt_len, x.tokens.size - x.prompt_len
        if x.temperature is not None:
            temp[i, p - 1:p - 1 + r] = torch.from_numpy(x.temperature)
        tokens[i, :n] = torch.from_numpy(x.tokens)
        labels[i, :n - 1] = tokens[i, 1:n]
        resp = slice(p - 1, p - 1 + r)  # positions whose logits predict the response tokens
        mask[i, resp] = torch.from_numpy(x.loss_mask.astype(np.float32))
        old[i, resp] = torch.from_numpy(x.rollout_logprobs)
        adv[i, resp] = x.advantage
        valid[i, :n - 1] = True
    routing = None
    if all(x.has_routing for x in samples):  # decoded here, one sample at a time
        routing = torch.from_numpy(pack_routing(
            [pad_last_row(x.routing()) for x in samples], s))  # type: ignore[arg-type]
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    return MicroBatch(tokens, pos, labels, mask, old, adv, routing, valid, list(samples), temp)


def filler_microbatch(seq_len: int, num_layers: int, top_k: int) -> MicroBatch:
    """A [1, seq_len] micro-batch that trains nothing: zero loss mask, no sample, no real routing
    row (filler routes only, so replay has ids to set and agreement counts none of it). Ranks
    pad with it to the micro-batch count of their peers (EP all-to-all, DP grad reduction)."""
    z = torch.zeros(1, seq_len)
    routing = torch.from_numpy(np.ascontiguousarray(
        np.broadcast_to(filler_row(num_layers, top_k), (1, seq_len, num_layers, top_k))))
    return MicroBatch(z.long(), torch.arange(seq_len).unsqueeze(0), z.long(), z.clone(),
                      z.clone(), z.clone(), routing, z.bool(), [], torch.ones(1, seq_len))


def split_microbatches(samples: Sequence[Sample], micro_batch_size: int,
                       pad_multiple: int = 8, device: torch.device | None = None
                       ) -> list[MicroBatch]:
    """Sort by length (less padding) and cut into micro-batches of `micro_batch_size`; each
    moved to `device` as soon as it is built (the host holds one micro-batch's copy at a time)."""
    order = sorted(samples, key=lambda x: x.tokens.size)
    return [moved(make_microbatch(order[i:i + micro_batch_size], pad_multiple), device)
            for i in range(0, len(order), micro_batch_size)]


def moved(mb: MicroBatch, device: torch.device | None) -> MicroBatch:
    """`mb` on `device` (as built when None)."""
    return mb if device is None else mb.to(device)


def update_schedule(mbs: Sequence[MicroBatch], epochs: int = 1,
                    mini_batches: int = 1) -> list[list[MicroBatch]]:
    """The micro-batches of each optimizer update of one step: `epochs` passes over the batch,
    each cut into `mini_batches` updates. Micro-batches are dealt round-robin (they are sorted by
    length, so each update mixes short and long sequences); every rank gets as many updates of
    as many micro-batches as the others when its micro-batch count is the same."""
    n = max(1, min(mini_batches, len(mbs)))
    return [list(mbs[i::n]) for _ in range(epochs) for i in range(n)]


def response_logprobs(mb: MicroBatch, lp_BS: torch.Tensor) -> list[np.ndarray]:
    """Per sample of `mb`: logprobs of its response tokens (packed or padded layout)."""
    return [lp_BS[b, o + s.prompt_len - 1:o + s.tokens.size - 1].float().cpu().numpy()
            for s, b, o in sample_spans(mb)]
