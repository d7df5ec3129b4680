"""Gather-based MoE permute / unpermute (model.moe_permute: gather, issue 55).

megatron-core 0.19 without TransformerEngine permutes a layer's tokens with an argsort of the
[E, T] routing map and `index_select`, and unpermutes with a bf16 `scatter_add_` into zeros; the
backward of the permute is an `index_add_`: bf16 atomics, 1.1 ms a layer at Qwen3-30B-A3B widths
on one H200 (docs/benchmarks/megatron-parallel.md). Dropless top-k routing gives every token
exactly K rows of the permuted tensor, so both directions can be written as gathers:

- `pos_TK`: the permuted rows of each token (its experts in ascending order), computed from the
  routing map with a cumulative sum (row p of the permuted tensor is megatron's row p: experts in
  ascending order, each expert's tokens in ascending order); `src_P` the token of each row.
- permute: forward `x[src_P]` (megatron's exact rows), backward `g[pos_TK].sum(K)`;
  unpermute: forward `y[pos_TK].sum(K)`, backward `g[src_P]`. The sums over K accumulate in
  fp32 (torch's reductions) and round once, where megatron's bf16 atomics round at every add and
  in no fixed order: the same values to bf16 rounding, deterministic.

No host sync: every shape is T x K. `GatherAlltoAll` (planned_dispatch.PlannedAlltoAll with these
two steps) also skips megatron's "permutation 2" (`sort_chunks_by_idxs` over the local
experts' chunks) where the tp x ep group is one rank: the sort is then the identity, and
megatron's split into El chunks and cat back (and their backward) are host launches and copies
for nothing.
Legend: T tokens, E experts, K top-k, P = T x K permuted rows, H hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.megatron.planned_dispatch import PlannedAlltoAll, PlannedMoELayer

FIELD = "model.moe_permute"


class GatherPlan:
    """Where each token's K rows go in megatron's permuted order, from a [T, E] routing map
    with exactly `top_k` experts per token (dropless)."""

    def __init__(self, routing_map_TE: torch.Tensor, top_k: int) -> None:
        rm = routing_map_TE.bool()
        t, e = rm.shape
        counts_E = rm.sum(0)
        start_E = torch.cumsum(counts_E, 0) - counts_E
        pos_TE = torch.cumsum(rm, 0, dtype=torch.long) - 1 + start_E
        # not routed -> past every row, so an ascending sort puts a token's K rows first
        pos_TE = torch.where(rm, pos_TE, t * e)
        pos_TK, self.expert_TK = torch.sort(pos_TE, dim=1)
        self.pos_TK = pos_TK[:, :top_k].contiguous()
        self.expert_TK = self.expert_TK[:, :top_k]
        tokens_TK = torch.arange(t, device=rm.device).unsqueeze(1).expand(t, top_k)
        self.src_P = torch.empty(t * top_k, dtype=torch.long, device=rm.device).scatter_(
            0, self.pos_TK.reshape(-1), tokens_TK.reshape(-1))

    def permute(self, x_TH: torch.Tensor, probs_TE: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """megatron's `permute(x, routing_map, probs, num_out_tokens=T*K)`: the rows and the
        probs of each row (None without `probs_TE`)."""
        out = _Permute.apply(x_TH, self.src_P, self.pos_TK)
        if probs_TE is None:
            return out, None
        probs_TK = probs_TE.gather(1, self.expert_TK)
        probs_P = probs_TK.new_empty(self.src_P.shape).scatter(
            0, self.pos_TK.reshape(-1), probs_TK.reshape(-1))
        return out, probs_P

    def unpermute(self, y_PH: torch.Tensor) -> torch.Tensor:
        """megatron's `unpermute(y, sorted_indices, restore_shape)` without probs: each
        token's K rows summed."""
        return _Unpermute.apply(y_PH, self.src_P, self.pos_TK)


def _sum_rows(rows_PH: torch.Tensor, pos_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over k of rows[pos[t, k]] (fp32 accumulation, one rounding)."""
    t, k = pos_TK.shape
    return rows_PH.index_select(0, pos_TK.reshape(-1)).view(t, k, -1).sum(1)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TH: torch.Tensor, src_P: torch.Tensor,
                pos_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pos_TK)
        return x_TH.index_select(0, src_P)

    @staticmethod
    def backward(ctx: Any, g_PH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (pos_TK,) = ctx.saved_tensors
        return _sum_rows(g_PH.contiguous(), pos_TK), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_PH: torch.Tensor, src_P: torch.Tensor,
                pos_TK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(src_P)
        return _sum_rows(y_PH, pos_TK)

    @staticmethod
    def backward(ctx: Any, g_TH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (src_P,) = ctx.saved_tensors
        return g_TH.contiguous().index_select(0, src_P), None, None



class GatherAlltoAll(PlannedAlltoAll):
    """PlannedAlltoAll whose permutation 1 and unpermutation 1 are GatherPlan's, and whose
    permutation 2 is skipped where it is the identity (the tp x ep group is one rank)."""

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, Any]:
        # megatron's MoEAlltoAllTokenDispatcher.dispatch_preprocess (dropless, unpadded:
        # _refuse), with GatherPlan.permute for moe_utils.permute
        self.hidden_shape, self.probs, self.routing_map = hidden_states.shape, probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
            "before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        self.gather_plan = GatherPlan(routing_map, self.config.moe_router_topk)
        return self.gather_plan.permute(hidden_states, probs)

    def _sort_is_identity(self) -> bool:
        return self.tp_size * self.ep_size == 1 and not self.drop_and_pad

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor,
                             global_probs: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        if not self._sort_is_identity():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        for point in ("before_permutation_2", "before_finish"):  # megatron's sync points
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                point, self.tokens_per_expert)
        tokens_per_expert = self.tokens_per_expert
        self.tokens_per_expert = None  # type: ignore[assignment]  # as megatron's own
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._sort_is_identity():  # tp 1 too: no reduce-scatter either
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor
                            ) -> torch.Tensor:
        output = self.gather_plan.unpermute(permutated_local_input_tokens)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

class GatherMoELayer(PlannedMoELayer):
    """PlannedMoELayer with the GatherAlltoAll dispatcher (model.moe_permute: gather)."""

    dispatcher_cls = GatherAlltoAll
