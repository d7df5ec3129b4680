"""The Trainer: policy (+ frozen reference) megatron models, optimizer, replay, and steps.

One Trainer per rank. `train_step(samples)` is one GRPO/PPO optimizer step:
  1. group-normalised advantages; samples cut into padded micro-batches (trainer.batch);
  2. old-policy logprob pass (no grad): r3 replays the rollout routing and measures routing
     agreement per layer and per trajectory unit (RoutingAgreementError below the floor names
     the groups to quarantine), r2 records the policy's own routing, off routes naturally;
     |rollout - trainer| logprob diff is measured here;
  3. reference pass (when kl_coef > 0) replaying the same routing;
  4. update: megatron forward_backward_func over the micro-batches (replay per micro-batch, FIFO
     REPLAY_BACKWARD when MoE activations are recomputed), grad clip + Adam; ids cleared. Every
     replaying forward (r3 and r2) checks that the experts used are the replayed ids, and the
     agreement floor is checked again before the optimizer step.
Legend: B batch rows, S sequence, V vocabulary, T router rows (S*B), K top-k.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial

import numpy as np
import torch

from trainer.alignment import LayerMap, check_routes, to_router_rows
from trainer.batch import (
    MicroBatch,
    Sample,
    filler_microbatch,
    split_microbatches,
    update_schedule,
)
from trainer.config import TrainerConfig
from trainer.loss import group_advantages, ppo_loss, sft_loss, token_logprobs
from trainer.megatron.cpu_shims import cuda_tensor_type_names
from trainer.megatron.hf_mapping import export_hf_state_dict, load_arch
from trainer.megatron.model import BuiltModel, build_model, init_parallel, resolve_router_dtype
from trainer.megatron.replay import AgreementMonitor, ModelReplay
from trainer.old_policy import OldPolicyPass
from trainer.replay import ReplayMode, RoutingAgreementError

log = logging.getLogger(__name__)


def max_over_ranks(value: int) -> int:
    """The largest `value` of all trainer ranks (an all-reduce over the world group)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True if `flag` is set on any trainer rank (an all-reduce over the world group)."""
    return bool(max_over_ranks(int(flag)))


def _tokens(mbs: Sequence[MicroBatch]) -> float:
    return float(sum(mb.num_tokens for mb in mbs))


def _optimizer(built: BuiltModel, cfg: TrainerConfig):
    """Wrap in megatron DDP and build Adam (get_megatron_optimizer)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16, o = cfg.model.dtype == "bf16", cfg.optim
    ddp = DDP(built.config, DistributedDataParallelConfig(
        use_distributed_optimizer=False, grad_reduce_in_fp32=True), built.module)
    with cuda_tensor_type_names():  # no-op on GPUs
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32), [ddp])
    built.config.finalize_model_grads_func = finalize_model_grads
    built.config.no_sync_func = ddp.no_sync
    return ddp, opt


class Trainer(OldPolicyPass):
    """Policy model + optimizer + replay on this rank (process groups initialised here)."""

    def __init__(self, cfg: TrainerConfig) -> None:
        if not cfg.model_dir:
            raise ValueError("model_dir: an HF checkpoint directory is required")
        init_parallel(cfg.model)
        # `auto` settings resolved against the checkpoint, so self.cfg says what runs.
        cfg = cfg.model_copy(update={"model": resolve_router_dtype(
            cfg.model, load_arch(cfg.model_dir).family)})
        log.info("resolved model config: %s", cfg.model.model_dump_json())
        self.cfg = cfg
        self.policy = build_model(cfg.model_dir, cfg.model)
        self.arch = self.policy.arch
        self.replay = ModelReplay(self.policy.replays, cfg.model.recompute_moe)
        self.agreement = AgreementMonitor(self.policy.routers, self.arch.moe_layers,
                                          self.arch.top_k)
        self.ddp, self.optimizer = _optimizer(self.policy, cfg)
        self.reference: BuiltModel | None = None
        if cfg.loss.kl_coef > 0:  # built after the policy: it owns its own replay instances
            self.reference = build_model(cfg.model_dir, cfg.model)
            self.reference.module.requires_grad_(False)
            self.ref_replay = ModelReplay(self.reference.replays, recompute=False)
        self.policy_version = 0
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self._layer_maps: dict[tuple[int, ...], LayerMap] = {}
        self.padded = 0  # filler micro-batches of the last `microbatches` call

    # ------------------------------------------------------------------ routing
    def layer_map(self, engine_layer_ids: Sequence[int]) -> LayerMap:
        """Engine layer columns -> this model's MoE layers (checked against the model config)."""
        key = tuple(int(x) for x in engine_layer_ids)
        if key not in self._layer_maps:
            self._layer_maps[key] = LayerMap.build(self.arch.moe_layers, key)
        return self._layer_maps[key]

    def _rows(self, mb: MicroBatch, mode: ReplayMode) -> list[torch.Tensor] | None:
        if mode == ReplayMode.R3:
            if mb.routing_BSLK is None:
                raise ValueError("replay.mode: r3 needs rollout routing on every sample")
            check_routes(mb.routing_BSLK, mb.valid_rows_BS, self.arch.num_experts,
                         self.arch.moe_layers, self.arch.top_k)
            return to_router_rows(mb.routing_BSLK)
        return mb.replay_rows if mode == ReplayMode.R2 else None

    def _drive(self, ctl: ModelReplay, rows: list[torch.Tensor] | None, record: bool) -> None:
        if rows is not None:
            ctl.replay_forward(rows)
        elif record:
            ctl.record()
        else:
            ctl.natural()

    def _logits(self, module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return module(input_ids=mb.tokens_BS, position_ids=mb.position_ids_BS,
                      attention_mask=None)

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def compute_logprobs(self, mbs: Sequence[MicroBatch], replay: ReplayMode | str,
                         reference: bool = False) -> list[torch.Tensor]:
        """Per micro-batch [B, S] logprobs of the labels (no grad); r2 records routing."""
        mode = ReplayMode(replay)
        model = self.reference if reference else self.policy
        ctl = self.ref_replay if reference else self.replay
        assert model is not None
        model.module.eval()
        out = []
        for mb in mbs:
            rows = self._rows(mb, mode)
            self._drive(ctl, rows, record=mode == ReplayMode.R2 and not reference)
            out.append(token_logprobs(self._logits(model.module, mb), mb.labels_BS,
                                      mb.temperature_BS))
            if not reference:
                self.agreement.collect(mb)
            if mode == ReplayMode.R2 and rows is None and not reference:
                mb.replay_rows = ctl.recorded()
            ctl.end_step()
        model.module.train()
        return out

    def sample_logprobs(self, samples: Sequence[Sample], replay: ReplayMode | str
                        ) -> list[np.ndarray]:
        """Trainer logprob of every response token of each sample (input order), no grad."""
        mbs = self.microbatches(samples)
        by_id = {}
        for mb, lp in zip(mbs, self.compute_logprobs(mbs, replay), strict=True):
            for b, s in enumerate(mb.samples):
                p, n = s.prompt_len, s.tokens.size
                by_id[id(s)] = lp[b, p - 1:n - 1].float().cpu().numpy()
        return [by_id[id(s)] for s in samples]

    def _forward_step(self, mode: ReplayMode, loss_fn, data_iter, model):
        mb = next(data_iter)
        rows = self._rows(mb, mode)
        self._drive(self.replay, rows, record=False)
        logits = self._logits(model, mb)
        self.agreement.collect(mb)
        self.replay.after_forward()
        return logits, partial(loss_fn, mb)

    def _run_update(self, mbs: Sequence[MicroBatch], mode: ReplayMode, loss_fn) -> float:
        """forward_backward_func over `mbs` + optimizer step; returns the grad norm."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        check = mode != ReplayMode.OFF and self.cfg.replay.check_agreement
        self.agreement.reset()
        self.agreement.enabled = check
        try:
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, mode, loss_fn),
                data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
                seq_length=int(mbs[0].tokens_BS.shape[1]),
                micro_batch_size=int(mbs[0].tokens_BS.shape[0]), forward_only=False)
            # Every rank finished its forward/backward: raising here strands no collective.
            self.agreement.check_used()
            if check:
                self.agreement.check(self.cfg.replay.agreement_floor)
            ok, grad_norm, _ = self.optimizer.step()
        finally:
            self.replay.end_step()
            self.agreement.enabled = False
        if not ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
        return float(grad_norm) if grad_norm is not None else float("nan")

    # ------------------------------------------------------------------ steps
    def microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Padded micro-batches of `samples`, as many on every rank (collective: every rank
        calls it in every pass). Ranks hold different sample counts (groups of different sizes,
        partial releases, quarantined groups) and every forward is an EP all-to-all and every
        update a DP grad reduction, so a rank with fewer pads up to the most with micro-batches
        that train nothing (`filler_microbatch`); `padded` counts them."""
        d = self.cfg.data
        mbs = split_microbatches(samples, d.micro_batch_size, d.pad_multiple)
        n = max_over_ranks(len(mbs))
        self.padded = n - len(mbs)
        if self.padded:
            log.info("%d micro-batches padded to the %d of the busiest rank", len(mbs), n)
        mbs += [filler_microbatch(d.pad_multiple, len(self.arch.moe_layers), self.arch.top_k)
                for _ in range(self.padded)]
        return [mb.to(self.device) for mb in mbs]

    def prepare(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Advantages (GRPO, per group) and padded micro-batches (as many on every rank)."""
        adv = group_advantages([s.reward for s in samples], [s.group_id for s in samples],
                               self.cfg.loss.adv_eps, self.cfg.loss.adv_std_normalize)
        for s, a in zip(samples, adv, strict=True):
            s.advantage = float(a)
        return self.microbatches(samples)

    def _ppo_loss_fn(self, total_tokens: float, n_mb: int, acc: dict, mb: MicroBatch, logits):
        old = mb.old_logprobs_BS if self.cfg.data.old_logprobs == "rollout" else mb.train_old_lp
        assert old is not None, "old-policy pass must run before the update"
        sums = ppo_loss(logits, mb.labels_BS, mb.loss_mask_BS, mb.advantages_BS, old,
                        mb.ref_lp, self.cfg.loss, mb.temperature_BS)
        for k in ("ppo_kl", "kl_ref", "clipped", "entropy"):
            acc[k] = acc.get(k, 0.0) + getattr(sums, k)
        loss = sums.loss / max(total_tokens, 1.0) * n_mb  # the schedule divides by n_mb
        acc["loss"] = acc.get("loss", 0.0) + float(loss.detach()) / n_mb
        return loss, {"loss": loss.detach()}

    def _checked_old_policy(self, samples: list[Sample], mode: ReplayMode
                            ) -> tuple[list[MicroBatch], dict, dict[str, str]]:
        """Old-policy pass; groups below the agreement floor are quarantined and the pass is
        redone without them. Every rank takes part in every redo (agreed after each pass, before
        the next collective), so one rank's bad group never strands its peers in all-to-all."""
        dropped: dict[str, str] = {}
        while True:
            mbs = self.prepare(samples)
            bad: dict[str, str] = {}
            try:
                metrics = self.old_policy_pass(mbs, mode) if mbs else {}
            except RoutingAgreementError as e:
                if not e.bad_groups:
                    raise
                bad, metrics = e.bad_groups, {}
            if not any_rank(bool(bad)):
                return mbs, metrics, dropped
            for g, why in bad.items():
                log.error("quarantining group %s: %s", g, why)
            dropped |= {g: "routing_agreement" for g in bad}
            samples = [s for s in samples if s.group_id not in bad]

    def train_step(self, samples: Sequence[Sample], replay: ReplayMode | str | None = None) -> dict:
        """One GRPO/PPO optimizer step on `samples`; returns its metrics (`dropped`: group id ->
        reason of the groups quarantined in this step)."""
        t0 = time.perf_counter()
        mode = ReplayMode(replay or self.cfg.replay.mode)
        mbs, metrics, dropped = self._checked_old_policy(list(samples), mode)
        samples = [s for s in samples if s.group_id not in dropped]
        metrics["dropped"] = dropped
        if not mbs:  # as many micro-batches on every rank: none anywhere
            return metrics | {"trajectories": 0, "policy_version": self.policy_version,
                              "replay": mode.value, "skipped": True}
        total = float(sum(mb.num_tokens for mb in mbs))
        acc: dict = {}
        updates = update_schedule(mbs, self.cfg.optim.ppo_epochs, self.cfg.optim.mini_batches)
        norms = [self._run_update(u, mode, partial(self._ppo_loss_fn, _tokens(u), len(u), acc))
                 for u in updates]
        self.policy_version += 1  # one version per step, however many updates it took
        dt = time.perf_counter() - t0
        # Per-token means over every update (ppo_kl is 0 in the first, > 0 after it).
        seen = total * self.cfg.optim.ppo_epochs
        metrics |= {k: acc.get(k, 0.0) / max(seen, 1.0) for k in ("ppo_kl", "kl_ref", "entropy")}
        metrics |= {"clip_ratio": acc.get("clipped", 0.0) / max(seen, 1.0),
                    "loss": acc.get("loss", 0.0) / len(updates),
                    "grad_norm": float(np.mean(norms)), "updates": len(updates),
                    "reward_mean": float(np.mean([s.reward for s in samples]))
                    if samples else None,
                    "trajectories": len(samples), "microbatches_padded": self.padded,
                    "step_seconds": dt, "tokens": total,
                    "tokens_per_second": sum(s.tokens.size for s in samples) / dt,
                    "policy_version": self.policy_version, "replay": mode.value}
        return metrics

    def sft_step(self, samples: Sequence[Sample]) -> dict:
        """Supervised step: cross-entropy on the response tokens (loss_mask), natural routing."""
        mbs = self.microbatches(samples)
        total, acc = float(sum(mb.num_tokens for mb in mbs)), {"loss": 0.0}

        def loss_fn(mb, logits):
            s, _ = sft_loss(logits, mb.labels_BS, mb.loss_mask_BS)
            acc["loss"] += float(s.detach()) / max(total, 1.0)
            loss = s / max(total, 1.0) * len(mbs)
            return loss, {"loss": loss.detach()}

        grad_norm = self._run_update(mbs, ReplayMode.OFF, loss_fn)
        self.policy_version += 1
        return {"loss": acc["loss"], "grad_norm": grad_norm, "tokens": total,
                "policy_version": self.policy_version}

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (EP shards gathered; collective over the EP group)."""
        return export_hf_state_dict(self.policy.module, self.arch)
