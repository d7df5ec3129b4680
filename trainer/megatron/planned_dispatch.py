"""Replay-aware MoE dispatch (model.planned_dispatch, issue 30): the all-to-all split sizes of a
whole pass, worked out before it runs.

megatron-core 0.19's alltoall dispatcher counts each MoE layer's tokens per expert on the device,
all-gathers the counts over the expert tensor x expert parallel group and copies the split sizes
to the host (a DtoH copy and an event sync) in every layer of every forward and every MoE
recompute: the host waits for the GPU once per layer. Under r3 and r2 the experts of every token
are the replayed ids, known before the pass: `StepPlan` counts them for every (micro-batch, MoE
layer) on the device, all-gathers the counts over the same group ONCE and copies them to the host
ONCE; `PlannedAlltoAll.preprocess` then sets the host values megatron's `preprocess` would have
computed (the same formulas, the same group rank order) and skips the copy and the sync.

Which plan a layer uses is decided by the ids its router replays: `PlannedMoELayer.route` peeks
at the RouterReplay before the router runs (REPLAY_FORWARD: `target_topk_idx`; REPLAY_BACKWARD:
the head of `replay_backward_list`, what the router is about to pop) and looks the tensor up in
the plan (by identity: the backend `bind`s each micro-batch's ids as it widens them for a
forward; the plan keeps none). No plan (natural routing, recording, off mode, a tensor not
planned) -> megatron's own preprocess, unchanged (`fallbacks` counts them).

The split sizes come from the plan, so every rank of the group sends and receives what its peers
expect even if a router went elsewhere; whether it did is checked on the device
(routing_map.sum(0) against the planned counts, no sync) and read once at the end of the pass,
where `AgreementMonitor` files it as a replay desync (ReplayDesyncError on every rank).
Legend: M micro-batches, L MoE layers of this stage, E experts, El local experts, W ranks of the
tp_ep group, T router tokens, K top-k.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

FIELD = "model.planned_dispatch"


@dataclass
class PlanEntry:
    """One (micro-batch, MoE layer) of a plan, as one forward or recompute uses it."""

    plan: StepPlan
    mb: int  # micro-batch index in the plan
    layer: int  # MoE layer index (this stage)
    forward: bool  # False: a backward recompute


def tokens_per_expert(rows: Sequence[torch.Tensor], num_experts: int,
                      device: torch.device) -> torch.Tensor:
    """[L, E] tokens per expert of one micro-batch's replay ids (one [T, K] int64 tensor per MoE
    layer), on `device`: what its planned forwards will route."""
    counts_LE = torch.zeros(len(rows), num_experts, dtype=torch.long, device=device)
    for m, ids in enumerate(rows):
        ids_N = ids.reshape(-1).to(device)
        counts_LE[m].scatter_add_(0, ids_N, torch.ones_like(ids_N))
    return counts_LE


class StepPlan:
    """Tokens per expert of every planned (micro-batch, MoE layer): on the device (this rank's,
    for the check) and on the host (every rank of the tp_ep group, for the split sizes).

    `counts[i]`: micro-batch i's tokens per expert, [L, E] (`tokens_per_expert` of its replay
    ids), or None (not planned). The plan keeps no ids: the backend widens a micro-batch's ids
    for each forward and `bind`s them, so a pass holds one micro-batch of int64 ids, not all.
    Collective over `group`: every rank of it builds its plan of the same pass with as many
    micro-batches."""

    def __init__(self, counts: Sequence[torch.Tensor | None], mbs: Sequence[Any],
                 num_layers: int, num_experts: int, group: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self.mbs = list(mbs)
        self.num_layers, self.num_experts = num_layers, num_experts
        counts_MLE = torch.zeros(len(counts), num_layers, num_experts, dtype=torch.long,
                                 device=device)
        for i, counts_LE in enumerate(counts):
            if counts_LE is None:
                continue
            if counts_LE.shape[0] != num_layers:
                raise ValueError(f"{FIELD}: {counts_LE.shape[0]} layers of replay ids for "
                                 f"{num_layers} MoE layers")
            counts_MLE[i] = counts_LE
        self._index = {id(mb): i for i, mb in enumerate(self.mbs)}
        # id(ids) -> (the ids, micro-batch, MoE layer), weakly: the routers' replay holds them
        self._key: dict[int, tuple[weakref.ref, int, int]] = {}
        self.counts_MLE = counts_MLE
        world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        gathered = torch.empty(world * counts_MLE.numel(), dtype=torch.long, device=device)
        if world > 1:
            dist.all_gather_into_tensor(gathered, counts_MLE.reshape(-1), group=group)
        else:
            gathered.copy_(counts_MLE.reshape(-1))
        # the pass's one DtoH copy: [W, M, L, E]
        self.host_WMLE = gathered.view(world, *counts_MLE.shape).cpu().numpy()
        self._checks: list[tuple[PlanEntry, torch.Tensor]] = []

    def bind(self, mb: Any, rows: Sequence[torch.Tensor]) -> None:
        """`rows` (the very tensors the routers are about to replay) are micro-batch `mb`'s
        for this forward and its recompute (a micro-batch the plan does not hold: not planned)."""
        i = self._index.get(id(mb))
        if i is None:
            return
        self._key.update({id(t): (weakref.ref(t), i, m) for m, t in enumerate(rows)})

    def entry(self, ids: torch.Tensor | None, forward: bool) -> PlanEntry | None:
        """The entry of the replayed ids `ids` (None: not planned)."""
        where = None if ids is None else self._key.get(id(ids))
        if where is None or where[0]() is not ids:  # a freed tensor's id, reused
            return None
        return PlanEntry(self, where[1], where[2], forward)

    def check(self, entry: PlanEntry, routing_map_TE: torch.Tensor) -> None:
        """Record, on the device, how many experts' counts differ from the plan's."""
        bad = (routing_map_TE.sum(0) != self.counts_MLE[entry.mb, entry.layer]).sum()
        self._checks.append((entry, bad))

    def checks(self) -> list[tuple[Any, int, bool, torch.Tensor]]:
        """(micro-batch, MoE layer, forward?, device count of mismatched experts) per planned
        forward/recompute so far (no sync)."""
        return [(self.mbs[e.mb], e.layer, e.forward, bad) for e, bad in self._checks]


def split_sizes(counts_WE: np.ndarray, rank: int, d: Any) -> dict[str, Any]:
    """What megatron's MoEAlltoAllTokenDispatcher.preprocess computes (dropless, no permute
    fusion) from the gathered counts [W, E] of one layer, W in the tp_ep group's rank order;
    host values of the types its DtoH point leaves (numpy splits, CPU tensors)."""
    local_E = counts_WE[rank]
    el, first = d.num_local_experts, d.local_expert_indices[0]
    out: dict[str, Any] = {}
    if d.ep_size > 1 or d.tp_size > 1:
        out["input_splits"] = local_E.reshape(d.ep_size, el).sum(axis=1)
        glob = counts_WE.reshape(d.ep_size, d.tp_size, -1).transpose(1, 0, 2)  # [tp, ep, E]
        local = np.ascontiguousarray(glob[:, :, first:first + el])  # [tp, ep, El]
        per_rank = local.sum(axis=2)  # [tp, ep]
        out["output_splits"] = per_rank[d.tp_rank]
        out["output_splits_tp"] = per_rank.sum(axis=1)
        tokens_per_expert = local.sum(axis=(0, 1))
    else:
        local = local_E
        tokens_per_expert = local_E
    out["tokens_per_expert"] = torch.from_numpy(np.ascontiguousarray(tokens_per_expert))
    if el > 1:
        out["num_global_tokens_per_local_expert"] = torch.from_numpy(local.reshape(-1, el))
    return out


class PlannedAlltoAll(MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher whose `preprocess` takes the split sizes from a plan
    entry (set by PlannedMoELayer.route) instead of a per-layer gather, DtoH copy and sync."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan_entry: PlanEntry | None = None
        self._dtoh_default = str(self.cuda_dtoh_point)  # type: ignore[has-type]
        self.planned = self.fallbacks = 0  # preprocess calls with / without a plan

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        entry, self.plan_entry = self.plan_entry, None
        if entry is None:
            self.fallbacks += 1
            self.cuda_dtoh_point, self.cuda_sync_point = self._dtoh_default, "no_sync"
            return super().preprocess(routing_map)
        self.planned += 1
        plan = entry.plan
        values = split_sizes(plan.host_WMLE[:, entry.mb, entry.layer], plan.rank, self)
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        for name, value in values.items():
            if name != "tokens_per_expert":
                setattr(self, name, value)
        self.cuda_dtoh_point = self.cuda_sync_point = "no_sync"  # nothing to copy or wait for
        plan.check(entry, routing_map)
        return values["tokens_per_expert"]


def _refuse(config: Any) -> None:
    """The dispatcher options the plan does not model, by name."""
    if config.moe_token_dispatcher_type != "alltoall":
        raise ValueError(f"{FIELD}: needs model.dispatcher alltoall, not "
                         f"{config.moe_token_dispatcher_type}")
    for opt in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
                "moe_router_padding_for_quantization", "moe_permute_fusion"):
        if getattr(config, opt, None):
            raise ValueError(f"{FIELD}: megatron's {opt} is set (the plan models dropless "
                             "dispatch without permute fusion only)")


class PlannedMoELayer(MoELayer):
    """megatron's MoELayer with a PlannedAlltoAll dispatcher; `plan` (set per pass by the
    backend, None outside) says which split sizes each replayed forward/recompute uses."""

    dispatcher_cls: type[PlannedAlltoAll] = PlannedAlltoAll  # gather_permute's for moe_permute

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None,
                 pg_collection: Any = None, **kwargs) -> None:
        from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

        _refuse(config)
        pg_collection = pg_collection if pg_collection is not None else \
            get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        old: Any = self.token_dispatcher  # type: ignore[has-type]
        self.token_dispatcher = self.dispatcher_cls(
            old.num_local_experts, old.local_expert_indices, config=self.config,
            pg_collection=pg_collection)
        if old.shared_experts is not None:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        if getattr(self, "_training_token_dispatcher", None) is old:
            self._training_token_dispatcher = self.token_dispatcher
        self.plan: StepPlan | None = None

    def _entry(self) -> PlanEntry | None:
        replay = self.router.router_replay
        if self.plan is None or replay is None:
            return None
        action = replay.router_replay_action
        if action == RouterReplayAction.REPLAY_FORWARD:
            return self.plan.entry(replay.target_topk_idx, forward=True)
        if action == RouterReplayAction.REPLAY_BACKWARD and replay.replay_backward_list:
            return self.plan.entry(replay.replay_backward_list[0], forward=False)
        return None

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        self.token_dispatcher.plan_entry = self._entry()  # consumed by its preprocess
        return super().route(hidden_states, padding_mask)


def planned_layers(module: torch.nn.Module) -> list[PlannedMoELayer]:
    """The PlannedMoELayers of a model (empty when model.planned_dispatch is off)."""
    return [m for m in module.modules() if isinstance(m, PlannedMoELayer)]


def dispatch_counts(layers: Sequence[PlannedMoELayer]) -> tuple[int, int]:
    """(planned, fallback) preprocess calls of these layers' dispatchers so far."""
    return (sum(m.token_dispatcher.planned for m in layers),
            sum(m.token_dispatcher.fallbacks for m in layers))
