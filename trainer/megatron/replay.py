"""Routing replay through megatron-core's native RouterReplay, plus the agreement check.

`ModelReplay` drives the RouterReplay instances of ONE model (policy or frozen reference): the
class-level instance list is cleared before each model is built (trainer.megatron.model), so each model's
own instances are held here and driven one by one. Per micro-batch: `replay_forward(rows)` sets
the ids and REPLAY_FORWARD; `after_forward()` switches to REPLAY_BACKWARD when MoE activations are
recomputed (megatron pops the ids FIFO, one entry per micro-batch forward, so recompute uses each
micro-batch's own routing); `end_step()` clears ids and action after every step.

`AgreementMonitor` hooks each router (a forward hook, no patching). In every replaying forward it
checks that the experts the router used are exactly the replayed ids (ReplayDesyncError: replay
bypassed or out of step), and recomputes the router's own logits with `router.gating(input)` to
count how many replayed ids its top-k would also have picked, per layer and per trajectory unit
(prompt rows, each segment's rows). A misaligned layer map, a row offset in any one segment or
bad ids bring a unit near chance (K/E); below `floor` `RoutingAgreementError` names the worst
trajectory/segment and layer and lists the groups to quarantine.
Legend: T router tokens (local, sequence-major), E experts, K top-k.
"""

from __future__ import annotations

import torch

from trainer.replay import AgreementStats


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


class AgreementMonitor(AgreementStats):
    """Routing agreement of replayed ids with the router's own choice, per layer and per
    trajectory unit (prompt rows, each segment's rows), and the used-equals-replayed check.

    The router hooks fire in every forward that replays (old-policy, update passes; r3 and r2):
      * used == replayed: the experts the router output (its routing map) must be exactly the
        ids set on its RouterReplay; anything else is a bypassed or desynchronised replay;
      * agreement (when `enabled`): how many replayed ids the router's own top-k also holds, per
        router token; `collect(mb)` then files the micro-batch's hits per layer and per sample
        unit, so a fault in a few rows of one segment is not diluted by the rest of the batch.
    """

    def __init__(self, routers: list, hf_layers: tuple[int, ...], top_k: int) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._fwd = RouterReplayAction.REPLAY_FORWARD
        super().__init__(hf_layers, top_k)
        self._handles = [r.register_forward_hook(self._hook(m)) for m, r in enumerate(routers)]

    def _hook(self, m: int):
        def hook(router, inputs, outputs) -> None:
            replay = router.router_replay
            if replay is None or replay.router_replay_action != self._fwd \
                    or replay.target_topk_idx is None:
                return  # natural routing, RECORD, or a backward recompute: nothing replayed
            with torch.no_grad():
                used_TE = outputs[1].bool()
                want_TE = torch.zeros_like(used_TE)
                want_TE.scatter_(1, replay.target_topk_idx.to(used_TE.device).long(), True)
                if self.desync is None and not torch.equal(used_TE, want_TE):
                    bad = int((used_TE != want_TE).any(-1).sum())
                    self.desync = (f"MoE layer {m} (HF layer {self.hf_layers[m]}): the router "
                                   f"used experts other than the replayed ids for {bad} of "
                                   f"{used_TE.shape[0]} tokens (replay bypassed or out of step)")
                if not self.enabled:
                    return
                logits_TE = router.gating(inputs[0]).view(-1, router.config.num_moe_experts)
                own_TE = torch.zeros_like(used_TE)
                own_TE.scatter_(1, logits_TE.topk(self.top_k, dim=-1).indices, True)
                self._hits[m] = (own_TE & want_TE).sum(-1)
        return hook

    def reset(self) -> None:
        super().reset()
        self._hits: list[torch.Tensor | None] = [None] * len(self.hf_layers)

    def collect(self, mb) -> None:
        """File the hits of `mb`'s forward (padded [B, S], router order t = s*B + b)."""
        hits, self._hits = self._hits, [None] * len(self.hf_layers)
        if any(h is None for h in hits):
            return
        b, s = mb.tokens_BS.shape
        hits_LBS = torch.stack([h.view(s, b).t() for h in hits]).cpu()  # type: ignore[union-attr]
        valid_BS = mb.valid_rows_BS.bool().cpu()
        for m in range(hits_LBS.shape[0]):
            self.agree[m] += int(hits_LBS[m][valid_BS].sum())
            self.total[m] += int(valid_BS.sum()) * self.top_k
        hits_BS = hits_LBS.sum(0)
        per_row = len(self.hf_layers) * self.top_k
        for i, sample in enumerate(mb.samples):
            for name, a, e in sample.agreement_units():
                cell = self.units.setdefault((sample.group_id, sample.trajectory_id, name), [0, 0])
                cell[0] += int(hits_BS[i, a:e].sum())
                cell[1] += (e - a) * per_row

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
