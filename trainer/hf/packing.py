"""Packed (unpadded) micro-batches for the HF backend, and replay rows in HF router order.

A packed micro-batch is one row [1, T]: the samples' tokens back to back, position ids restarting
at 0 for every sample, and a tail of `pad_multiple` padding that forms its own position run.
transformers (5.x, `masking_utils.find_packed_sequence_indices`) turns restarting position ids
into a block-diagonal causal mask when no attention mask is passed, so samples never attend to
each other. Routing rows follow the tokens: sample i's [n_i, L, K] (last row padded, as in the
megatron path) at its offset, filler rows elsewhere. The tensors are the same `MicroBatch` the
megatron trainer uses (B = 1), so the loss code is shared unchanged.
Legend: T packed tokens, L MoE layers, K top-k, B batch rows, S sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainer.samples.alignment import filler_row, pad_last_row
from trainer.samples.batch import MicroBatch, Sample, moved


def _pad_len(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def sample_offsets(samples: Sequence[Sample]) -> list[int]:
    """Start of each sample in its packed row."""
    return [int(x) for x in np.cumsum([0] + [s.tokens.size for s in samples])[:-1]]


def _packed_routing(samples: Sequence[Sample], total: int) -> torch.Tensor | None:
    if not all(s.has_routing for s in samples):
        return None
    per_sample = [s.routing() for s in samples]  # decoded here when left encoded (intake)
    num_layers, k = per_sample[0].shape[1:]  # type: ignore[union-attr]
    dtype = np.result_type(*(r.dtype for r in per_sample))  # type: ignore[union-attr]
    out_TLK = np.empty((total, num_layers, k), dtype=dtype)  # widened when used (routed_ids)
    out_TLK[:] = filler_row(num_layers, k)
    for off, s, r in zip(sample_offsets(samples), samples, per_sample, strict=True):
        out_TLK[off:off + s.tokens.size] = pad_last_row(r)  # type: ignore[arg-type]
    return torch.from_numpy(out_TLK).unsqueeze(0)


def pack_microbatch(samples: Sequence[Sample], pad_multiple: int = 8) -> MicroBatch:
    """Pack `samples` into one [1, T] micro-batch (T padded to `pad_multiple`)."""
    used = sum(s.tokens.size for s in samples)
    total = _pad_len(used, pad_multiple)
    tokens, labels, pos = (torch.zeros(total, dtype=torch.long) for _ in range(3))
    mask, old, adv = (torch.zeros(total, dtype=torch.float32) for _ in range(3))
    valid = torch.zeros(total, dtype=torch.bool)
    temp = torch.ones(total, dtype=torch.float32)
    for o, x in zip(sample_offsets(samples), samples, strict=True):
        n, p, r = x.tokens.size, x.prompt_len, x.tokens.size - x.prompt_len
        tokens[o:o + n] = torch.from_numpy(x.tokens)
        labels[o:o + n - 1] = tokens[o + 1:o + n]
        pos[o:o + n] = torch.arange(n)
        resp = slice(o + p - 1, o + p - 1 + r)  # positions whose logits predict the response
        mask[resp] = torch.from_numpy(x.loss_mask.astype(np.float32))
        old[resp] = torch.from_numpy(x.rollout_logprobs)
        adv[resp] = x.advantage
        if x.temperature is not None:
            temp[resp] = torch.from_numpy(x.temperature)
        valid[o:o + n - 1] = True
    pos[used:] = torch.arange(total - used)  # the padding tail is a run of its own
    return MicroBatch(tokens.unsqueeze(0), pos.unsqueeze(0), labels.unsqueeze(0),
                      mask.unsqueeze(0), old.unsqueeze(0), adv.unsqueeze(0),
                      routing_BSLK=_packed_routing(samples, total),
                      valid_rows_BS=valid.unsqueeze(0), samples=list(samples),
                      temperature_BS=temp.unsqueeze(0))


def pack_microbatches(samples: Sequence[Sample], micro_batch_size: int,
                      pad_multiple: int = 8, device: torch.device | None = None
                      ) -> list[MicroBatch]:
    """Cut `samples` (in order) into packed micro-batches of `micro_batch_size` samples, each
    moved to `device` as soon as it is built (`split_microbatches`)."""
    return [moved(pack_microbatch(samples[i:i + micro_batch_size], pad_multiple), device)
            for i in range(0, len(samples), micro_batch_size)]


def hf_router_rows(ids_BSLK: torch.Tensor) -> list[torch.Tensor]:
    """[B, S, L, K] -> per MoE layer [B*S, K] int64 in HF router order (t = b*S + s), widened
    layer by layer (no [T, L, K] int64 besides the rows)."""
    b, s, num_layers, k = ids_BSLK.shape
    rows_TLK = ids_BSLK.reshape(b * s, num_layers, k)
    return [rows_TLK[:, m].long().contiguous() for m in range(num_layers)]
