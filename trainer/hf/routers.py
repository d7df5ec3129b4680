"""Routing replay for HF transformers MoE routers through forward hooks (no patched classes).

In transformers 5.x every supported MoE block calls its router module `gate` and uses what it
returns, `(router_logits, top_k_weights, top_k_index)`, to combine the experts. A forward hook on
the router may return a replacement output (PyTorch's documented hook contract), so in REPLAY the
hook swaps `top_k_index` for the replayed ids and recomputes `top_k_weights` from the live
`router_logits` with the router's own normalisation; the weights stay a differentiable function
of the router weight, so the router keeps getting gradients. Two families:
  * softmax top-k (Qwen2-MoE, Qwen3-MoE, OLMoE): softmax(logits, fp32) -> gather -> renorm if
    `norm_topk_prob` -> cast to the logits dtype; Mixtral always renormalises (no flag);
  * grouped sigmoid (DeepSeek-V3, GLM-4.x MoE): sigmoid(logits) -> gather (scores WITHOUT
    `e_score_correction_bias`: the bias only steers selection) -> renorm if `norm_topk_prob`
    (+1e-20 as upstream) -> * `routed_scaling_factor`. Group-limited selection (n_group,
    topk_group) is selection only, so replayed ids need no group constraint;
  * GPT-OSS: logits carry the router's bias; softmax over the k gathered logits, in their dtype.
The router is the MoE block's `gate` (GPT-OSS: `router`); a shared expert and its gate (Qwen2-MoE's
sigmoid `shared_expert_gate`, DeepSeek/GLM's ungated `shared_experts`) sit outside the router and
run unchanged.
RECORD keeps the router's own choice (R2 old-policy pass). The router still computes its own
top-k in REPLAY; that choice is what the agreement check compares against.
Row order is the router's: hidden [B, S, H] flattened batch-major (t = b*S + s); packed samples
are B=1. Under sequence parallelism each rank's router sees only its slice of the sequence, so
`replay_forward` takes the full rows and keeps this rank's slice.
Legend: T router tokens, E experts, K top-k, H hidden, B batch rows, S sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from services.common import families
from trainer.replay import AgreementStats
from trainer.samples.alignment import shard_sequence_parallel


def softmax_topk_weights(router: Any, logits_TE: torch.Tensor,
                         ids_TK: torch.Tensor) -> torch.Tensor:
    """Qwen2/Qwen3-MoE/OLMoE gate weights of `ids_TK` (fp32, cast by the caller)."""
    w_TK = torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(-1, ids_TK)
    if router.norm_topk_prob:
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
    return w_TK


def grouped_sigmoid_weights(router: Any, logits_TE: torch.Tensor,
                            ids_TK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 gate weights of `ids_TK`: unbiased sigmoid scores, renorm, scale."""
    w_TK = logits_TE.float().sigmoid().gather(-1, ids_TK)
    if router.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return w_TK * router.routed_scaling_factor


def renormalised_softmax_weights(router: Any, logits_TE: torch.Tensor,
                                 ids_TK: torch.Tensor) -> torch.Tensor:
    """Mixtral gate weights of `ids_TK`: softmax (fp32), gather, always renormalised."""
    w_TK = torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(-1, ids_TK)
    return w_TK / w_TK.sum(dim=-1, keepdim=True)


def topk_softmax_weights(router: Any, logits_TE: torch.Tensor,
                         ids_TK: torch.Tensor) -> torch.Tensor:
    """GPT-OSS gate weights of `ids_TK`: softmax over the gathered (biased) logits."""
    return torch.softmax(logits_TE.gather(-1, ids_TK), dim=-1, dtype=logits_TE.dtype)


WeightFn = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]

# Replay rule -> how it recomputes gate weights. Which router class follows which rule is a fact of
# its family (services.common.families: `hf_routers`, the classes whose forward we have read in
# transformers 5.24). Anything else is refused: a router with another normalisation would be
# replayed with silently wrong gate weights.
RULES: dict[str, WeightFn] = {
    "softmax_topk": softmax_topk_weights,
    "renormalised_softmax": renormalised_softmax_weights,
    "grouped_sigmoid": grouped_sigmoid_weights,
    "topk_softmax": topk_softmax_weights,
}


def router_rules() -> dict[str, tuple[str, WeightFn]]:
    """HF router class name -> (rule, weight function), over every registered family."""
    return {cls: (rule, RULES[rule]) for f in families.all_families()
            for cls, rule in f.hf_routers.items()}


@dataclass(frozen=True)
class RouterHandle:
    """One MoE layer's router in an HF model."""

    hf_layer: int
    module: Any  # the HF router nn.Module (attributes differ per family)
    family: str
    weights: WeightFn

    @property
    def num_experts(self) -> int:
        return int(self.module.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.module.top_k)


@dataclass(frozen=True)
class RoutingArch:
    """The routing facts of a model that alignment needs (as megatron's MoeArch has them)."""

    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]  # HF layer index of each MoE layer

    @classmethod
    def of(cls, routers: Sequence[RouterHandle]) -> RoutingArch:
        """From a model's routers; every MoE layer must have the same E and K."""
        shapes = {(r.num_experts, r.top_k) for r in routers}
        if len(shapes) != 1:
            raise ValueError(f"router: MoE layers differ in (num_experts, top_k): {shapes}")
        (e, k), = shapes
        return cls(e, k, tuple(r.hf_layer for r in routers))


def decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The decoder layers of an HF causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no `model.layers` decoder stack")
    return layers


def find_routers(model: torch.nn.Module) -> list[RouterHandle]:
    """Routers of every MoE layer in order; ValueError for a router family we do not know."""
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        gate = getattr(mlp, "gate", None)
        gate = getattr(mlp, "router", None) if gate is None else gate  # GPT-OSS: `router`
        if gate is None or not hasattr(mlp, "experts"):
            continue  # dense layer
        name, rules = type(gate).__name__, router_rules()
        if name not in rules:
            raise ValueError(f"router: {name} at layer {i} is not a supported router family "
                             f"(supported: {sorted(rules)})")
        family, fn = rules[name]
        out.append(RouterHandle(i, gate, family, fn))
    if not out:
        raise ValueError(f"model: {type(model).__name__} has no MoE layers")
    return out


class ReplayAction(StrEnum):
    NATURAL = "natural"  # the router's own top-k
    REPLAY = "replay"  # replace the ids, recompute the gate weights
    RECORD = "record"  # the router's own top-k, kept for a later replay (R2)


class HFAgreementMonitor(AgreementStats):
    """Routing agreement for HF routers: same counters, per-layer / per-(unit, layer) check (and
    error) as trainer.megatron.replay.AgreementMonitor (trainer.replay.AgreementStats); fed by
    the replay hook, which already holds the router's own top-k, instead of megatron router
    hooks. Hits accumulate on the router's device, per layer and per micro-batch (`collect`),
    and are read back only when asked for: a host sync per layer per micro-batch stalls the GPU
    queue (with it and the per-pass route check, r3/off was 1.06-1.13 on an H200)."""

    def __init__(self, hf_layers: tuple[int, ...], top_k: int, num_experts: int,
                 sp: tuple[int, int] = (0, 1)) -> None:
        self.num_experts, self.sp = num_experts, sp  # (rank, size) of sequence parallelism
        self.valid_T: torch.Tensor | None = None
        super().__init__(hf_layers, top_k)

    def mine(self, x_T: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole row's router tokens (all of them without SP)."""
        return shard_sequence_parallel(x_T, *self.sp)

    def reset(self) -> None:
        super().reset()
        self._pending: list[list[torch.Tensor]] = [[] for _ in self.hf_layers]
        self._valid: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None
        self._mb_hits: list[torch.Tensor | None] = [None] * len(self.hf_layers)
        self._by_mb: list[tuple[Any, torch.Tensor]] = []  # (micro-batch, hits [L, T] on device)

    def _valid_mask(self, hits_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float mask, its sum) of `valid_T`, computed once per micro-batch, not per layer."""
        if self._valid is None or self._valid[0] is not self.valid_T \
                or self._valid[1].device != hits_T.device:
            src = self.valid_T if self.valid_T is not None else torch.ones_like(hits_T)
            mask = src.to(hits_T.device, non_blocking=True).float()
            self._valid = (self.valid_T, mask, mask.sum())
        if self._valid[1].shape[0] != hits_T.shape[0]:
            raise ValueError(f"agreement: {self._valid[1].shape[0]} valid flags for "
                             f"{hits_T.shape[0]} router tokens")
        return self._valid[1], self._valid[2]

    @torch.no_grad()
    def observe(self, m: int, own_TK: torch.Tensor, replay_TK: torch.Tensor) -> None:
        """Count replayed ids of MoE layer m that the router's own top-k also holds."""
        if not self.enabled:
            return
        hits_T = (replay_TK.unsqueeze(-1) == own_TK.unsqueeze(-2)).any(-1).sum(-1)
        mask_T, n_valid = self._valid_mask(hits_T)
        self._pending[m].append(torch.stack([torch.dot(hits_T.float(), mask_T), n_valid]))
        self._mb_hits[m] = hits_T

    def collect(self, mb) -> None:
        """Keep the per-token hits of `mb`'s forward (every layer) for its units."""
        hits, self._mb_hits = self._mb_hits, [None] * len(self.hf_layers)
        if all(h is not None for h in hits):
            self._by_mb.append((mb, torch.stack(hits)))  # type: ignore[arg-type]

    def _flush(self) -> None:
        for m, parts in enumerate(self._pending):
            if parts:
                agree, valid = (round(x) for x in torch.stack(parts).sum(0).tolist())
                self.agree[m] += agree
                self.total[m] += valid * self.top_k
        self._pending = [[] for _ in self.hf_layers]
        rank, size = self.sp
        for mb, hits_Lt in self._by_mb:  # router order t = b*S + s (B = 1 under SP)
            b, s = mb.tokens_BS.shape
            mine_S = torch.zeros(s, dtype=torch.bool, device=hits_Lt.device)
            mine_S[rank * s // size:(rank + 1) * s // size] = True
            hits_LBS = torch.zeros(hits_Lt.shape[0], b, s, dtype=hits_Lt.dtype,
                                   device=hits_Lt.device)
            hits_LBS[:, :, mine_S] = hits_Lt.view(-1, b, s // size)
            self.file_units(mb, hits_LBS, mine_S)
        self._by_mb = []


class HFModelReplay:
    """Replay control for ONE model's routers (policy or reference), through forward hooks.

    trainer.replay.ReplayController, as trainer.megatron.replay.ModelReplay: `replay_forward(rows)` per micro-batch,
    `record()` / `recorded()` for R2, `natural()`, `end_step()`. Ids stay set until `end_step`, so
    an activation-checkpointing recompute in backward re-runs the router with the same ids
    (`after_forward` has nothing to switch, unlike megatron's FIFO).
    """

    def __init__(self, routers: Sequence[RouterHandle],
                 monitor: HFAgreementMonitor | None = None, sp: tuple[int, int] = (0, 1)) -> None:
        self.routers, self.monitor, self.sp = list(routers), monitor, sp
        self.action = ReplayAction.NATURAL
        self._ids: list[torch.Tensor | None] = [None] * len(self.routers)
        self._recorded: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [r.module.register_forward_hook(self._hook(m))
                         for m, r in enumerate(self.routers)]

    def replay_forward(self, rows_per_layer: Sequence[torch.Tensor], sp_rank: int | None = None,
                       sp_size: int | None = None) -> None:
        """Replay these ids ([T, K] per MoE layer, router order) in the next forwards; under
        sequence parallelism (`sp` of the constructor unless given) the rows are the whole
        sequence and this rank keeps its slice."""
        sp_rank = self.sp[0] if sp_rank is None else sp_rank
        sp_size = self.sp[1] if sp_size is None else sp_size
        if len(rows_per_layer) != len(self.routers):
            raise ValueError(f"routing: {len(rows_per_layer)} layers for "
                             f"{len(self.routers)} MoE layers")
        for m, ids in enumerate(rows_per_layer):
            self._ids[m] = shard_sequence_parallel(ids.long(), sp_rank, sp_size)
        self.action = ReplayAction.REPLAY

    def after_forward(self) -> None:
        """Nothing to switch: the ids stay set for a recompute until `end_step`."""

    def record(self) -> None:
        """The next forward records the router's own top-k (R2 old-policy pass)."""
        self.action = ReplayAction.RECORD

    def recorded(self) -> list[torch.Tensor]:
        """Ids recorded by the last forward, one [T, K] per MoE layer."""
        if any(t is None for t in self._recorded):
            raise RuntimeError("replay: nothing recorded (record() before the forward)")
        return [t for t in self._recorded if t is not None]

    def natural(self) -> None:
        """Route with the model's own routers."""
        self.action = ReplayAction.NATURAL

    def end_step(self) -> None:
        """Drop ids and recordings; back to natural routing."""
        self.action = ReplayAction.NATURAL
        self._ids = [None] * len(self.routers)
        self._recorded = [None] * len(self.routers)

    def remove(self) -> None:
        """Detach the hooks (the model routes naturally afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, m: int):
        router = self.routers[m]

        def hook(module, inputs, outputs):
            if self.action == ReplayAction.NATURAL:
                return None
            logits_TE, weights_TK, own_TK = outputs
            if self.action == ReplayAction.RECORD:
                self._recorded[m] = own_TK.detach().clone()
                return None
            ids_TK = self._replay_ids(m, logits_TE)
            if self.monitor is not None:
                self.monitor.observe(m, own_TK, ids_TK)
            new_TK = router.weights(module, logits_TE, ids_TK).to(weights_TK.dtype)
            return logits_TE, new_TK, ids_TK
        return hook

    def _replay_ids(self, m: int, logits_TE: torch.Tensor) -> torch.Tensor:
        ids_TK = self._ids[m]
        if ids_TK is None:
            raise RuntimeError(f"replay: no ids set for MoE layer {m}")
        if ids_TK.shape[0] != logits_TE.shape[0]:
            raise ValueError(f"routing: MoE layer {m} (HF layer {self.routers[m].hf_layer}) has "
                             f"{ids_TK.shape[0]} replay rows for {logits_TE.shape[0]} tokens")
        if ids_TK.device != logits_TE.device:
            ids_TK = self._ids[m] = ids_TK.to(logits_TE.device)
        return ids_TK
