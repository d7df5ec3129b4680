"""Routing replay through megatron-core's native RouterReplay, plus the agreement check.

`ModelReplay` drives the RouterReplay instances of ONE model (policy or frozen reference): the
class-level instance list is cleared before each model is built (trainer.megatron.model), so each model's
own instances are held here and driven one by one. Per micro-batch: `replay_forward(rows)` sets
the ids and REPLAY_FORWARD; `after_forward()` switches to REPLAY_BACKWARD when MoE activations are
recomputed (megatron pops the ids FIFO, one entry per micro-batch forward, so recompute uses each
micro-batch's own routing; without recompute it drops the ids); `end_step()` clears ids and
action after every step.

`AgreementMonitor` hooks each router (a forward hook, no patching). In every replaying forward it
checks that the experts the router used are exactly the replayed ids (ReplayDesyncError: replay
bypassed or out of step), and recomputes the router's own choice (`router.gating(input)`, then
megatron's routing function with the router's options: `own_topk`) to count how many replayed ids
it would also have picked, per layer and per (trajectory unit, MoE layer) (units: prompt rows,
each segment's rows). A misaligned layer map, a row offset in any one segment, one randomised
layer or bad ids bring a cell near chance (K/E); below `floor` `RoutingAgreementError` names the
worst trajectory/segment and layer and lists the groups to quarantine. A desync is filed with
the micro-batch it happened in (ReplayDesyncError names those groups when only some did).
The used-equals-replayed checks (and the dispatch plan's, trainer.megatron.planned_dispatch) stay
on the device until the verdict (`sync` / `check_recomputed`): one host copy per pass, not one
sync per layer per forward.
Legend: T router tokens (local, sequence-major), E experts, K top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.replay import AgreementStats, UnitKey


class ModelReplay:
    """Native RouterReplay control for one model's routers."""

    def __init__(self, replays: list, recompute: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._replays, self._recompute, self._action = replays, recompute, RouterReplayAction
        self._replaying = False  # the current forward replays ids (else natural / record)

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
        self._replaying = True

    def after_forward(self) -> None:
        """Before backward: recompute must pop this micro-batch's ids, not reuse the last (a
        natural-routing forward queued none: its recompute routes naturally too). Without
        recompute the backward runs no router: the ids are dropped here (RouterReplay queues
        every micro-batch's for a backward replay that nothing would pop before end_step)."""
        if not self._replaying:
            return
        if self._recompute:
            self._set(self._action.REPLAY_BACKWARD)
        else:
            for r in self._replays:
                r.clear_indices()

    def record(self) -> None:
        """The next forward records the router's own top-k (R2 old-policy pass)."""
        self._set(self._action.RECORD)
        self._replaying = False

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
        self._replaying = False

    def end_step(self) -> None:
        """Clear queued/recorded ids and the action (after every step)."""
        for r in self._replays:
            r.clear_indices()
            r.clear_router_replay_action()
        self._replaying = False


def own_topk(router: Any, logits_TE: torch.Tensor) -> torch.Tensor:
    """[T, K] ids the router would pick itself on `logits_TE`: megatron's routing function with
    the router's options (score function, selection bias, expert groups), replay left out."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    c = router.config
    _, ids_TK = topk_routing_with_score_function(
        logits_TE, router.topk, use_pre_softmax=c.moe_router_pre_softmax,
        num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
        scaling_factor=c.moe_router_topk_scaling_factor, score_function=router.score_function,
        expert_bias=router.expert_bias, dense_output=True)
    return ids_TK


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

    # device checks not read yet (_resolve): (forward index | None, MoE layer, kind, count, T)
    _checks: list[tuple[int | None, int, str, torch.Tensor, int]]
    _plan_checks: list[tuple[Any, int, bool, torch.Tensor]]
    _forwards: list[Any]

    def __init__(self, routers: list, hf_layers: tuple[int, ...], top_k: int,
                 recompute: bool = False, group: Any = None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._fwd, self._bwd = RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD
        self._recompute, self._group, self._local_layers = recompute, group, tuple(hf_layers)
        super().__init__(hf_layers, top_k)
        self._handles = [r.register_forward_hook(self._hook(m)) for m, r in enumerate(routers)]

    def _used(self, m: int, used_TE: torch.Tensor, ids_TK: torch.Tensor, forward: bool) -> None:
        """Count, on the device, the tokens whose experts differ from the replayed ids (read
        with every other check at `_resolve`: no host sync per layer)."""
        want_TE = torch.zeros_like(used_TE)
        want_TE.scatter_(1, ids_TK.to(used_TE.device).long(), True)
        bad = (used_TE != want_TE).any(-1).sum()
        # a forward's check belongs to the micro-batch collect() files next; a recompute's to none
        self._checks.append((len(self._forwards) if forward else None, m, "used", bad,
                             used_TE.shape[0]))

    def add_plan_checks(self, checks: list[tuple[Any, int, bool, torch.Tensor]]) -> None:
        """File the dispatch plan's device checks (trainer.megatron.planned_dispatch:
        micro-batch, MoE layer, forward?, experts whose routed count differs from the plan)."""
        self._plan_checks.extend(checks)

    def _resolve(self) -> None:
        """Read every pending device check in one copy; count each micro-batch's forward for
        the desync verdict and keep the first mismatch's message."""
        forwards, checks, plan = self._forwards, self._checks, self._plan_checks
        self._forwards, self._checks, self._plan_checks = [], [], []
        flags = [c[3] for c in checks] + [c[3] for c in plan]
        counts = torch.stack([f.reshape(()) for f in flags]).tolist() if flags else []
        bad_fwd: set[int] = set()
        for (f, m, _, _, n), bad in zip(checks, counts[:len(checks)], strict=True):
            if bad:
                self._desynced(m, f is not None, f"the router used experts other than the "
                               f"replayed ids for {bad} of {n} tokens")
                if f is not None:
                    bad_fwd.add(f)
        bad_mbs: set[int] = set()
        for (mb, m, forward, _), bad in zip(plan, counts[len(checks):], strict=True):
            if bad:
                self._desynced(m, forward, f"the routed tokens per expert differ from the "
                               f"dispatch plan's at {bad} experts")
                if forward:
                    bad_mbs.add(id(mb))
        for f, mb in enumerate(forwards):
            self.note_forward(mb, f in bad_fwd or id(mb) in bad_mbs)

    def _desynced(self, m: int, forward: bool, what: str) -> None:
        if not forward:
            self.unattributed = True  # a recompute's mismatch belongs to no one micro-batch
        if self.desync is None:
            self.desync = (f"MoE layer {m} (HF layer {self._local_layers[m]}): {what} in "
                           f"{'a forward' if forward else 'a backward recompute'} (replay "
                           "bypassed or out of step)")

    def _recomputed(self, m: int, used_TE: torch.Tensor) -> None:
        """A backward recompute must use the ids of the oldest forward not yet recomputed."""
        self.recomputes[m] += 1
        if not self._fifo[m]:
            self.unattributed = True
            self.desync = self.desync or (f"MoE layer {m} (HF layer {self.hf_layers[m]}): a "
                                          "recompute with no forward left to replay")
            return
        self._used(m, used_TE, self._fifo[m].pop(0), forward=False)

    def _hook(self, m: int):
        def hook(router, inputs, outputs) -> None:
            replay = router.router_replay
            action = None if replay is None else replay.router_replay_action
            if action == self._bwd and self._recompute and router.training:
                with torch.no_grad():
                    self._recomputed(m, outputs[1].bool())
                return
            if replay is None or action != self._fwd or replay.target_topk_idx is None:
                return  # natural routing or RECORD: nothing replayed
            with torch.no_grad():
                used_TE = outputs[1].bool()
                self._used(m, used_TE, replay.target_topk_idx, forward=True)
                if self._recompute and router.training:
                    self.forwards[m] += 1
                    self._fifo[m].append(replay.target_topk_idx)
                want_TE = torch.zeros_like(used_TE)
                want_TE.scatter_(1, replay.target_topk_idx.to(used_TE.device).long(), True)
                if not self.enabled:
                    return
                logits_TE = router.gating(inputs[0]).view(-1, router.config.num_moe_experts)
                own_TE = torch.zeros_like(used_TE)
                own_TE.scatter_(1, own_topk(router, logits_TE), True)
                self._hits[m] = (own_TE & want_TE).sum(-1)
        return hook

    def reset(self) -> None:
        self.hf_layers, self._synced = self._local_layers, False
        super().reset()
        n = len(self.hf_layers)
        self._hits: list[torch.Tensor | None] = [None] * n
        # ids of each training forward, oldest first, until its backward recompute replays them
        self._fifo: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.forwards, self.recomputes = [0] * n, [0] * n
        self._checks, self._plan_checks = [], []
        self._forwards = []  # micro-batch of each forward collect() filed

    def sync(self) -> None:
        """Merge the counters of the model-parallel group (TP ranks route other tokens, PP
        stages other layers of the same samples), so every rank of it judges, reports and
        quarantines the same: per HF layer and per unit sums, the first desync. Collective over
        the group; once per pass (reset() re-arms it)."""
        self._resolve()
        if self._group is None or self._synced:
            return
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(parts, (self.hf_layers, self.agree, self.total, self.units,
                                       self.desync, self.desync_groups,
                                       (self.mbs_seen, self.mbs_desynced, self.unattributed)),
                                group=self._group)
        layers = sorted({h for p in parts for h in p[0]})
        agree, total = [0] * len(layers), [0] * len(layers)
        units: dict[UnitKey, list[int]] = {}
        for hf, a, t, u, *_ in parts:
            for h, x, y in zip(hf, a, t, strict=True):
                agree[layers.index(h)] += x
                total[layers.index(h)] += y
            for key, (x, y) in u.items():
                cell = units.setdefault(key, [0, 0])
                cell[0] += x
                cell[1] += y
        self.hf_layers, self.agree, self.total, self.units = tuple(layers), agree, total, units
        self.desync = next((p[4] for p in parts if p[4] is not None), None)
        self.desync_groups = {g: why for p in parts for g, why in p[5].items()}
        # every rank of the group runs the same micro-batches: a micro-batch desynced on any
        self.mbs_seen = max(p[6][0] for p in parts)
        self.mbs_desynced = max(p[6][1] for p in parts)
        self.unattributed = any(p[6][2] for p in parts)
        self._synced = True

    def check_used(self) -> None:
        self.sync()
        super().check_used()

    def check_recomputed(self) -> None:
        """After an update with recompute: every recomputed layer replayed each forward's ids
        exactly once, in order (a layer the recompute skips keeps all of its forwards)."""
        self._resolve()
        for m in range(len(self._local_layers)):
            if self.recomputes[m] and self.recomputes[m] != self.forwards[m]:
                self.unattributed = True
                self.desync = self.desync or (
                    f"MoE layer {m} (HF layer {self.hf_layers[m]}): {self.forwards[m]} forwards "
                    f"but {self.recomputes[m]} backward recomputes replayed")
        self.check_used()

    def collect(self, mb, pos_S: torch.Tensor | None = None) -> None:
        """File the hits of `mb`'s forward (padded [B, S], router order t = s*B + b over the
        sequence positions `pos_S` this rank routes; None = all of them), per MoE layer and per
        (unit, MoE layer); count the forward for the desync verdict. The sums are taken on the
        hits' device and come to the host in two small copies (per-layer and per-cell sums):
        per-layer or per-unit indexing of host tensors cost ~0.4 s per 4K-token micro-batch on
        the bench's host."""
        self._forwards.append(mb)  # counted for the desync verdict at _resolve
        hits, self._hits = self._hits, [None] * len(self.hf_layers)
        if not hits or any(h is None for h in hits):
            return
        b, s = mb.tokens_BS.shape
        dev = hits[0].device  # type: ignore[union-attr]
        pos_S = torch.arange(s, device=dev) if pos_S is None else pos_S.to(dev)
        hits_LBS = torch.zeros(len(hits), b, s, dtype=torch.long, device=dev)
        hits_LBS[:, :, pos_S] = torch.stack([h.view(-1, b).t() for h in hits])  # type: ignore[union-attr]
        mine_S = torch.zeros(s, dtype=torch.long, device=dev)
        mine_S[pos_S] = 1
        valid_BS = mb.valid_rows_BS.to(dev).bool().long() * mine_S
        sums = torch.cat([(hits_LBS * valid_BS).sum((1, 2)), valid_BS.sum().view(1)]).tolist()
        for m in range(len(hits)):
            self.agree[m] += int(sums[m])
            self.total[m] += int(sums[-1]) * self.top_k
        self.file_units(mb, hits_LBS, mine_S)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
