"""HFTrainer: the GRPO/PPO trainer on an HF transformers MoE model (FSDP2), with routing replay.

Same public methods and metrics as trainer.megatron.engine.Trainer (megatron backend) and the same pieces
underneath: advantages, PPO/SFT loss and logprob diff from trainer.loss, samples and padded
micro-batches from trainer.batch (or packed ones from trainer.hf.packing), the layer map and
route checks from trainer.alignment, the agreement floor and its error from trainer.megatron.replay.
Replay is trainer.hf.routers (router forward hooks). Per step:
  1. advantages; micro-batches (packed [1, T] by default);
  2. old-policy pass (no grad): r3 replays the rollout routing and checks agreement, r2 records
     the policy's own routing, off routes naturally; reference pass replays the same routing;
  3. update: per micro-batch forward + backward (FSDP2 reduce-scatters on the last one), grad
     clip, AdamW; replay ids cleared after the step.
Legend: B batch rows, S sequence, V vocabulary, T router tokens, K top-k.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from trainer.alignment import LayerMap, check_routes
from trainer.batch import MicroBatch, Sample, split_microbatches, update_schedule
from trainer.config import TrainerConfig
from trainer.hf.config import HFBackendConfig
from trainer.hf.model import export_hf, init_process_group, load_model, shard
from trainer.hf.packing import hf_router_rows, pack_microbatches, response_logprobs
from trainer.hf.routers import (
    HFAgreementMonitor,
    HFModelReplay,
    RoutingArch,
    decoder_layers,
    find_routers,
)
from trainer.loss import group_advantages, ppo_loss, sft_loss, token_logprobs
from trainer.old_policy import OldPolicyPass
from trainer.replay import ReplayMode

log = logging.getLogger(__name__)

LossFn = Callable[[MicroBatch, torch.Tensor], torch.Tensor]


class HFTrainer(OldPolicyPass):
    """Policy (+ frozen reference) HF model, AdamW and routing replay on this rank."""

    def __init__(self, cfg: TrainerConfig, hf: HFBackendConfig | None = None) -> None:
        if not cfg.model_dir:
            raise ValueError("model_dir: an HF checkpoint directory is required")
        if cfg.model.expert_parallel != 1:
            raise ValueError("model.expert_parallel: the hf backend shards with FSDP2, EP must be 1")
        if cfg.model.router_dtype == "fp32" and cfg.model.dtype == "bf16":
            log.warning("model.router_dtype=fp32 is ignored by the hf backend: HF routers run in "
                        "the model dtype (bf16), as vLLM's do")
        self.cfg, self.hf = cfg, hf or HFBackendConfig.model_validate({})
        self.rank, self.world_size = init_process_group()
        self.sharded = self._use_fsdp()
        self.model = self._build(trainable=True)
        self.routers = find_routers(self.model)
        self.arch = RoutingArch.of(self.routers)
        self.moe_layers, self.num_experts, self.top_k = (
            self.arch.moe_layers, self.arch.num_experts, self.arch.top_k)
        self.agreement = HFAgreementMonitor(self.moe_layers, self.top_k, self.num_experts)
        self.agreement.enabled = False
        self.replay = HFModelReplay(self.routers, self.agreement)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            weight_decay=o.weight_decay)
        self.reference: Any = None
        self.ref_replay: HFModelReplay | None = None
        if cfg.loss.kl_coef > 0:
            self.reference = self._build(trainable=False)
            if self.hf.reference_replay:
                self.ref_replay = HFModelReplay(find_routers(self.reference))
            elif cfg.replay.mode != ReplayMode.OFF:
                log.warning("loss.kl_coef=%s with replay.mode=%s but hf.reference_replay is off: "
                            "the reference routes naturally, so kl_ref mixes routing and policy "
                            "drift", cfg.loss.kl_coef, cfg.replay.mode.value)
        self.policy_version = 0
        self.device = next(self.model.parameters()).device
        self._layer_maps: dict[tuple[int, ...], LayerMap] = {}

    def _use_fsdp(self) -> bool:
        if self.hf.fsdp == "off":
            if self.world_size > 1:
                raise ValueError(f"hf.fsdp: off needs world size 1 (have {self.world_size})")
            if self.cfg.model.dtype == "bf16":
                log.warning("hf.fsdp=off with model.dtype=bf16: parameters stay fp32 (no FSDP2 "
                            "mixed precision without sharding)")
            return False
        return self.world_size > 1 or self.cfg.model.dtype == "bf16"

    def _build(self, trainable: bool) -> Any:  # an HF PreTrainedModel (FSDP2-wrapped or not)
        model = load_model(self.cfg.model_dir, self.hf.attn_implementation)
        if trainable and self.hf.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if not trainable:
            model.requires_grad_(False)
        if self.sharded:
            shard(model, decoder_layers(model), self.cfg.model.dtype == "bf16",
                  self.hf.reshard_after_forward)
        return model

    # ------------------------------------------------------------------ routing
    def layer_map(self, engine_layer_ids: Sequence[int]) -> LayerMap:
        """Engine layer columns -> this model's MoE layers (checked against the model)."""
        key = tuple(int(x) for x in engine_layer_ids)
        if key not in self._layer_maps:
            self._layer_maps[key] = LayerMap.build(self.moe_layers, key)
        return self._layer_maps[key]

    def _rows(self, mb: MicroBatch, mode: ReplayMode) -> list[torch.Tensor] | None:
        if mode == ReplayMode.R3:
            return self._r3_rows(mb)
        return mb.replay_rows if mode == ReplayMode.R2 else None

    def _stage(self, mbs: Sequence[MicroBatch], mode: ReplayMode) -> None:
        """Validate and upload every micro-batch's r3 rows before the first forward: the check
        reads a device mask back, and one sync per step beats one per micro-batch."""
        if mode == ReplayMode.R3:
            for mb in mbs:
                self._r3_rows(mb)

    def _r3_rows(self, mb: MicroBatch) -> list[torch.Tensor]:
        """Rollout routing of `mb` in router order, validated and moved to the device ONCE per
        micro-batch (kept on the micro-batch): per-pass checks and pageable copies would each
        stall the GPU queue."""
        rows = getattr(mb, "_hf_r3_rows", None)
        if rows is None:
            if mb.routing_BSLK is None:
                raise ValueError("replay.mode: r3 needs rollout routing on every sample")
            ids = mb.routing_BSLK
            if self.device.type == "cuda":  # check on the device: CPU masking cost ~5 ms/mb
                ids = ids.pin_memory().to(self.device, non_blocking=True)
            check_routes(ids, mb.valid_rows_BS, self.num_experts, self.moe_layers, self.top_k)
            rows = hf_router_rows(ids)
            mb._hf_r3_rows = rows  # type: ignore[attr-defined]
        return rows

    @staticmethod
    def _drive(ctl: HFModelReplay, rows: list[torch.Tensor] | None, record: bool) -> None:
        if rows is not None:
            ctl.replay_forward(rows)
        elif record:
            ctl.record()
        else:
            ctl.natural()

    @staticmethod
    def _logits(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        # no attention mask: causal, and block-diagonal for packed rows (restarting positions)
        return model(input_ids=mb.tokens_BS, position_ids=mb.position_ids_BS,
                     use_cache=False).logits

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def compute_logprobs(self, mbs: Sequence[MicroBatch], replay: ReplayMode | str,
                         reference: bool = False) -> list[torch.Tensor]:
        """Per micro-batch [B, S] logprobs of the labels (no grad); r2 records routing."""
        mode = ReplayMode(replay)
        model = self.reference if reference else self.model
        assert model is not None
        ctl = self.ref_replay if reference else self.replay
        model.eval()
        self._stage(mbs, mode)
        out = []
        for mb in mbs:
            rows = self._rows(mb, mode)
            if ctl is not None:
                self._drive(ctl, rows, record=mode == ReplayMode.R2 and not reference)
            self.agreement.valid_T = mb.valid_rows_BS.reshape(-1)
            out.append(token_logprobs(self._logits(model, mb), mb.labels_BS, mb.temperature_BS))
            if ctl is not None and mode == ReplayMode.R2 and rows is None and not reference:
                mb.replay_rows = ctl.recorded()
            if ctl is not None:
                ctl.end_step()
        model.train()
        return out

    def microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Packed (hf.packing) or padded micro-batches, on this rank's device."""
        d = self.cfg.data
        cut = pack_microbatches if self.hf.packing else split_microbatches
        return [mb.to(self.device) for mb in cut(samples, d.micro_batch_size, d.pad_multiple)]

    def sample_logprobs(self, samples: Sequence[Sample], replay: ReplayMode | str
                        ) -> list[np.ndarray]:
        """Trainer logprob of every response token of each sample (input order), no grad."""
        mbs = self.microbatches(samples)
        by_id = {}
        for mb, lp in zip(mbs, self.compute_logprobs(mbs, replay), strict=True):
            for s, resp in zip(mb.samples, response_logprobs(mb, lp), strict=True):
                by_id[id(s)] = resp
        return [by_id[id(s)] for s in samples]

    def _run_update(self, mbs: Sequence[MicroBatch], mode: ReplayMode, loss_fn: LossFn) -> float:
        """Forward/backward over `mbs` + clip + AdamW; returns the (global) grad norm."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stage(mbs, mode)
        try:
            for i, mb in enumerate(mbs):
                if self.sharded:  # accumulate unsharded grads; reduce-scatter once at the end
                    self.model.set_requires_gradient_sync(i == len(mbs) - 1)
                self._drive(self.replay, self._rows(mb, mode), record=False)
                loss_fn(mb, self._logits(self.model, mb)).backward()
                self.replay.end_step()
        finally:
            self.replay.end_step()
        clip = self.cfg.optim.clip_grad or float("inf")
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        if not np.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"optimizer step skipped (grad norm {norm})")
        self.optimizer.step()
        return norm

    # ------------------------------------------------------------------ steps
    def prepare(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Advantages (GRPO, per group) and micro-batches."""
        adv = group_advantages([s.reward for s in samples], [s.group_id for s in samples],
                               self.cfg.loss.adv_eps, self.cfg.loss.adv_std_normalize)
        for s, a in zip(samples, adv, strict=True):
            s.advantage = float(a)
        return self.microbatches(samples)

    def _ppo_loss(self, total: float, acc: dict, mb: MicroBatch, logits: torch.Tensor):
        old = mb.old_logprobs_BS if self.cfg.data.old_logprobs == "rollout" else mb.train_old_lp
        assert old is not None, "old-policy pass must run before the update"
        sums = ppo_loss(logits, mb.labels_BS, mb.loss_mask_BS, mb.advantages_BS, old,
                        mb.ref_lp, self.cfg.loss, mb.temperature_BS)
        for k in ("ppo_kl", "kl_ref", "clipped", "entropy"):
            acc[k] = acc.get(k, 0.0) + getattr(sums, k)
        loss = sums.loss / max(total, 1.0)
        acc["loss"] = acc.get("loss", 0.0) + float(loss.detach())
        return loss

    def train_step(self, samples: Sequence[Sample], replay: ReplayMode | str | None = None) -> dict:
        """One GRPO/PPO optimizer step on `samples`; returns its metrics."""
        t0 = time.perf_counter()
        mode = ReplayMode(replay or self.cfg.replay.mode)
        mbs = self.prepare(samples)
        metrics = self.old_policy_pass(mbs, mode)
        total = float(sum(mb.num_tokens for mb in mbs))
        acc: dict = {}
        updates = update_schedule(mbs, self.cfg.optim.ppo_epochs, self.cfg.optim.mini_batches)
        norms = [self._run_update(u, mode, partial(
            self._ppo_loss, float(sum(mb.num_tokens for mb in u)), acc)) for u in updates]
        self.policy_version += 1  # one version per step, however many updates it took
        dt = time.perf_counter() - t0
        seen = total * self.cfg.optim.ppo_epochs
        per_tok = {k: acc.get(k, 0.0) / max(seen, 1.0) for k in ("ppo_kl", "kl_ref", "entropy")}
        return metrics | per_tok | {
            "clip_ratio": acc.get("clipped", 0.0) / max(seen, 1.0),
            "loss": acc.get("loss", 0.0) / len(updates), "updates": len(updates),
            "grad_norm": float(np.mean(norms)),
            "reward_mean": float(np.mean([s.reward for s in samples])),
            "step_seconds": dt, "tokens": total,
            "tokens_per_second": sum(s.tokens.size for s in samples) / dt,
            "policy_version": self.policy_version, "replay": mode.value}

    def sft_step(self, samples: Sequence[Sample]) -> dict:
        """Supervised step: cross-entropy on the response tokens (loss_mask), natural routing."""
        mbs = self.microbatches(samples)
        total, acc = float(sum(mb.num_tokens for mb in mbs)), {"loss": 0.0}

        def loss_fn(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            s, _ = sft_loss(logits, mb.labels_BS, mb.loss_mask_BS)
            acc["loss"] += float(s.detach()) / max(total, 1.0)
            return s / max(total, 1.0)

        grad_norm = self._run_update(mbs, ReplayMode.OFF, loss_fn)
        self.policy_version += 1
        return {"loss": acc["loss"], "grad_norm": grad_norm, "tokens": total,
                "policy_version": self.policy_version}

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named full weights (collective under FSDP2: every rank must call it)."""
        dtype = torch.bfloat16 if self.cfg.model.dtype == "bf16" else torch.float32
        return export_hf(self.model, dtype)
