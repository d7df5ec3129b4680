"""Routing replay through megatron-core's native RouterReplay, plus the agreement check.

`ModelReplay` drives the RouterReplay instances of ONE model (policy or frozen reference): the
class-level instance list is cleared before each model is built (trainer.model), so each model's
own instances are held here and driven one by one. Per micro-batch: `replay_forward(rows)` sets
the ids and REPLAY_FORWARD; `after_forward()` switches to REPLAY_BACKWARD when MoE activations are
recomputed (megatron pops the ids FIFO, one entry per micro-batch forward, so recompute uses each
micro-batch's own routing); `end_step()` clears ids and action after every step.

`AgreementMonitor` hooks each router (a forward hook, no patching): it recomputes the router's own
logits with `router.gating(input)`, takes their top-k and counts how many replayed ids the router
would also have picked. A misaligned layer map, an off-by-one row offset or all-zero routes bring
it near chance (K/E); below `floor` the step fails with `RoutingAgreementError` naming the layer.
Legend: T router tokens (local, sequence-major), E experts, K top-k.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class ReplayMode(StrEnum):
    R3 = "r3"  # replay the rollout engine's routing
    R2 = "r2"  # record in the old-policy logprob pass, replay in the update passes
    OFF = "off"


class RoutingAgreementError(ValueError):
    """Replayed routing disagrees with the trainer's router below the configured floor."""


class ModelReplay:
    """Native RouterReplay control for one model's routers."""

    def __init__(self, replays: list, recompute: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._replays, self._recompute, self._action = replays, recompute, RouterReplayAction

    def _set(self, action) -> None:
        for r in self._replays:
            r.set_router_replay_action(action)

    def replay_forward(self, rows_per_layer: list[torch.Tensor]) -> None:
        """Queue this micro-batch's ids ([T, K] per MoE layer) and replay them in forward."""
        if len(rows_per_layer) != len(self._replays):
            raise ValueError(f"routing: {len(rows_per_layer)} layers for "
                             f"{len(self._replays)} MoE layers")
        for r, ids in zip(self._replays, rows_per_layer, strict=True):
            r.set_target_indices(ids.long())
        self._set(self._action.REPLAY_FORWARD)

    def after_forward(self) -> None:
        """Before backward: recompute must pop this micro-batch's ids, not reuse the last."""
        if self._recompute:
            self._set(self._action.REPLAY_BACKWARD)

    def record(self) -> None:
        """The next forward records the router's own top-k (R2 old-policy pass)."""
        self._set(self._action.RECORD)

    def recorded(self) -> list[torch.Tensor]:
        """Ids recorded by the last forward, one [T, K] per MoE layer (cloned)."""
        out = [r.get_recorded_indices() for r in self._replays]
        if any(t is None for t in out):
            raise RuntimeError("RouterReplay: nothing recorded (record() before the forward)")
        return [t.detach().clone() for t in out]

    def natural(self) -> None:
        """Route with the model's own router (no replay)."""
        for r in self._replays:
            r.clear_router_replay_action()

    def end_step(self) -> None:
        """Clear queued/recorded ids and the action (after every step)."""
        for r in self._replays:
            r.clear_indices()
            r.clear_router_replay_action()


class AgreementMonitor:
    """Per-layer fraction of replayed expert ids that the router itself would choose."""

    def __init__(self, routers: list, hf_layers: tuple[int, ...], top_k: int) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._fwd = RouterReplayAction.REPLAY_FORWARD
        self.hf_layers, self.top_k = hf_layers, top_k
        self.valid_T: torch.Tensor | None = None  # rows to count (real engine routing)
        self.enabled = True
        self.agree = [0] * len(routers)
        self.total = [0] * len(routers)
        self._handles = [r.register_forward_hook(self._hook(m)) for m, r in enumerate(routers)]

    def _hook(self, m: int):
        def hook(router, inputs, outputs) -> None:
            replay = router.router_replay
            if not self.enabled or replay is None or replay.router_replay_action != self._fwd:
                return  # natural routing, RECORD, or a backward recompute: nothing to compare
            with torch.no_grad():
                logits_TE = router.gating(inputs[0]).view(-1, router.config.num_moe_experts)
                own_TE = torch.zeros_like(outputs[1], dtype=torch.bool)
                own_TE.scatter_(1, logits_TE.topk(self.top_k, dim=-1).indices, True)
                hits_T = (own_TE & outputs[1].bool()).sum(-1)
                valid = self.valid_T if self.valid_T is not None else torch.ones_like(hits_T)
                valid = valid.to(hits_T.device).bool()
                self.agree[m] += int(hits_T[valid].sum())
                self.total[m] += int(valid.sum()) * self.top_k
        return hook

    def reset(self) -> None:
        self.agree = [0] * len(self.agree)
        self.total = [0] * len(self.total)

    def per_layer(self) -> dict[int, float]:
        """MoE layer index -> agreement ratio (layers that saw no replayed tokens are left out)."""
        return {m: a / t for m, (a, t) in enumerate(zip(self.agree, self.total, strict=True))
                if t}

    def overall(self) -> float | None:
        total = sum(self.total)
        return sum(self.agree) / total if total else None

    def check(self, floor: float) -> None:
        """Raise RoutingAgreementError naming the worst layer below `floor`."""
        bad = {m: r for m, r in self.per_layer().items() if r < floor}
        if bad:
            m = min(bad, key=lambda layer: bad[layer])
            raise RoutingAgreementError(
                f"routing agreement {bad[m]:.3f} < floor {floor} at MoE layer {m} (HF layer "
                f"{self.hf_layers[m]}); MoE layers below floor: {sorted(bad)} - misaligned "
                "layer map, row offset or bad ids?")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
