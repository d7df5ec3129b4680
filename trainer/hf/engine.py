"""HFBackend (trainer.backend.TrainBackend): an HF transformers MoE model (FSDP2), AdamW and
routing replay through router forward hooks (trainer.hf.routers); the step is trainer.grpo's.

Micro-batches are packed [1, T] (hf.packing) or padded [B, S] (trainer.samples.batch). An update is a
per micro-batch forward + backward (FSDP2 reduce-scatters on the last one), grad clip, AdamW;
replay ids cleared after the step. r3 ids are validated and moved to the device once per
micro-batch, before the first forward of a pass (`_stage`).
Legend: B batch rows, S sequence, V vocabulary, T router tokens, K top-k.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint import ShardedState
from trainer.config import TrainerConfig
from trainer.guard import Level, PeerFault, checkpoint
from trainer.hf.config import HFBackendConfig, hf_section
from trainer.hf.loading import build_meta, materialise
from trainer.hf.model import (
    check_packing,
    device_mesh,
    export_hf,
    fill_derived_buffers,
    init_process_group,
    iter_export_hf,
    load_model,
    shard,
)
from trainer.hf.packing import hf_router_rows, pack_microbatches
from trainer.hf.routers import (
    HFAgreementMonitor,
    HFModelReplay,
    RoutingArch,
    decoder_layers,
    find_routers,
)
from trainer.hf.ulysses import (
    ATTN_NAME,
    UlyssesAttention,
    check_heads,
    gather_rows,
    gather_sequence,
    group_samples,
    register,
    sp_groups,
)
from trainer.megatron.config import model_section
from trainer.protocol import LossFn
from trainer.ranks.collectives import max_over_ranks
from trainer.replay import ReplayMode, drive
from trainer.samples.alignment import check_routes
from trainer.samples.batch import (
    MicroBatch,
    Sample,
    compact_ids,
    filler_microbatch,
    routed_ids,
    split_microbatches,
)

log = logging.getLogger(__name__)


class HFBackend:
    """Policy (+ frozen reference) HF model, AdamW and routing replay on this rank."""

    def __init__(self, cfg: TrainerConfig, hf: HFBackendConfig | None = None) -> None:
        if not cfg.model_dir:
            raise ValueError("model_dir: an HF checkpoint directory is required")
        model = model_section(cfg)
        if model.expert_parallel != 1:
            raise ValueError("model.expert_parallel: the hf backend shards with FSDP2, EP must be 1")
        if model.router_dtype == "fp32" and model.dtype == "bf16":
            log.warning("model.router_dtype=fp32 is ignored by the hf backend: HF routers run in "
                        "the model dtype (bf16), as vLLM's do")
        cfg = cfg.fast_path(torch.cuda.is_available())  # `auto` switches: this rank's device
        log.info("%s", cfg.describe_path())
        self.cfg, self.hf = cfg, hf or hf_section(cfg)
        self.rank, self.world_size = init_process_group()
        self.hf.check_world(self.world_size)
        self.sharded = self._use_fsdp()
        self.mesh = device_mesh(self.hf.mesh_shape(self.world_size)) if self.sharded else None
        self._sequence_parallel()
        # FSDP2 averages gradients over the ranks (a sequence-parallel group's P ranks hold the
        # same samples: `update` scales their loss by P); unsharded is one rank
        self.data_parallel_size = self.world_size // self.sp if self.sharded else 1
        self.model = self._build(trainable=True)
        check_heads(self.model.config, self.sp)
        check_packing(self.model, self.hf.packing)
        self.routers = find_routers(self.model)
        self.arch = RoutingArch.of(self.routers)
        self.moe_layers, self.num_experts, self.top_k = (
            self.arch.moe_layers, self.arch.num_experts, self.arch.top_k)
        self.agreement = HFAgreementMonitor(self.moe_layers, self.top_k, self.num_experts,
                                            sp=(self.sp_rank, self.sp))
        self.agreement.enabled = False
        self.replay = HFModelReplay(self.routers, self.agreement, sp=(self.sp_rank, self.sp))
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            weight_decay=o.weight_decay)
        self.reference: Any = None
        self.ref_replay: HFModelReplay | None = None
        if cfg.loss.uses_reference:
            self.reference = self._build(trainable=False)
            if self.hf.reference_replay:
                self.ref_replay = HFModelReplay(find_routers(self.reference),
                                                sp=(self.sp_rank, self.sp))
            elif cfg.replay.mode != ReplayMode.OFF:
                log.warning("loss.kl_coef=%s with replay.mode=%s but hf.reference_replay is off: "
                            "the reference routes naturally, so kl_ref mixes routing and policy "
                            "drift", cfg.loss.kl_coef, cfg.replay.mode.value)
        self.device = next(self.model.parameters()).device
        self.padded = 0  # filler micro-batches of the last `microbatches` call
        self.current: MicroBatch | None = None  # in a forward/backward now (fault blame)

    def _sequence_parallel(self) -> None:
        """hf.sequence_parallel: this rank's group, its rank in it, and the Ulysses attention
        the model is built with (trainer.hf.ulysses); P = 1 leaves the model as configured."""
        self.sp, self.sp_rank, self.sp_group = self.hf.sequence_parallel, 0, None
        self.attn_implementation: str = self.hf.attn_implementation
        if self.sp > 1:
            self.sp_group, self.sp_rank = sp_groups(self.sp)
            self.ulysses = UlyssesAttention(self.sp_group, self.sp)
            register(self.ulysses)
            self.attn_implementation = ATTN_NAME

    def _use_fsdp(self) -> bool:
        if self.hf.fsdp == "off":
            if self.world_size > 1:
                raise ValueError(f"hf.fsdp: off needs world size 1 (have {self.world_size})")
            if model_section(self.cfg).dtype == "bf16":
                log.warning("hf.fsdp=off with model.dtype=bf16: parameters stay fp32 (no FSDP2 "
                            "mixed precision without sharding)")
            return False
        return self.world_size > 1 or model_section(self.cfg).dtype == "bf16"

    def _build(self, trainable: bool) -> Any:  # an HF PreTrainedModel (FSDP2-wrapped or not)
        meta = self.sharded and self.hf.meta_init
        model = build_meta(self.cfg.model_dir, self.attn_implementation) if meta else \
            load_model(self.cfg.model_dir, self.attn_implementation)
        if trainable and self.hf.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if not trainable:
            model.requires_grad_(False)
        if self.sharded:
            shard(model, decoder_layers(model), model_section(self.cfg).dtype == "bf16",
                  self.hf.reshard_after_forward, self.mesh)
        if meta:  # this rank's shards only, read from the checkpoint
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
            fill_derived_buffers(model, materialise(model, self.cfg.model_dir, device))
        return model

    # ------------------------------------------------------------------ routing
    def _rows(self, mb: MicroBatch, mode: ReplayMode) -> list[torch.Tensor] | None:
        if mode == ReplayMode.R3:
            return self._r3_rows(mb)
        if mode == ReplayMode.R2 and mb.replay_rows is not None:
            return [t.long() for t in mb.replay_rows]  # int64 for one forward
        return None

    def _stage(self, mbs: Sequence[MicroBatch], mode: ReplayMode) -> None:
        """Validate and upload every micro-batch's r3 routing before the first forward: the
        check reads a device mask back, and one sync per step beats one per micro-batch."""
        if mode == ReplayMode.R3:
            for mb in mbs:
                self._r3_ids(mb)

    def _r3_ids(self, mb: MicroBatch) -> torch.Tensor:
        """Rollout routing of `mb` in the codec's dtype, validated and moved to the device ONCE
        per micro-batch (kept on the micro-batch): per-pass checks and pageable copies would
        each stall the GPU queue."""
        if mb.routing_BSLK is None:
            raise ValueError("replay.mode: r3 needs rollout routing on every sample")
        if not getattr(mb, "_hf_r3_checked", False):
            # checked on the device (CPU masking cost ~5 ms/mb); MicroBatch.to has usually
            # moved it already (pinning a CUDA tensor raised: r3 failed on every GPU)
            if self.device.type == "cuda" and mb.routing_BSLK.device.type == "cpu":
                mb.routing_BSLK = mb.routing_BSLK.pin_memory().to(self.device, non_blocking=True)
            check_routes(routed_ids(mb.routing_BSLK), mb.valid_rows_BS, self.num_experts,
                         self.moe_layers, self.top_k)  # int64 of this micro-batch, dropped
            mb._hf_r3_checked = True  # type: ignore[attr-defined]
        return mb.routing_BSLK

    def _r3_rows(self, mb: MicroBatch) -> list[torch.Tensor]:
        """`mb`'s rollout routing in router order, widened to int64 for one forward (the
        routers hold it until end_step, after that micro-batch's backward)."""
        return hf_router_rows(self._r3_ids(mb))

    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """[B, S, V] logits of `mb`; under sequence parallelism this rank runs its slice of the
        row and the slices' logits are gathered (every rank of the group holds them all)."""
        # no attention mask: causal, and block-diagonal for packed rows (restarting positions)
        if self.sp == 1:
            return model(input_ids=mb.tokens_BS, position_ids=mb.position_ids_BS,
                         use_cache=False).logits
        self.ulysses.begin(mb.position_ids_BS)
        n = mb.tokens_BS.shape[1] // self.sp
        mine = slice(self.sp_rank * n, (self.sp_rank + 1) * n)
        local = model(input_ids=mb.tokens_BS[:, mine], position_ids=mb.position_ids_BS[:, mine],
                      use_cache=False).logits
        return gather_sequence(local, self.sp_group, self.sp, self.sp_rank)

    # ------------------------------------------------------------------ no-grad passes
    @contextmanager
    def no_grad_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode,
                     reference: bool) -> Iterator[None]:
        model = self.reference if reference else self.model
        assert model is not None
        model.eval()
        self._stage(mbs, mode)
        try:
            yield
        finally:
            model.train()

    def logits(self, mb: MicroBatch, mode: ReplayMode, reference: bool = False) -> torch.Tensor:
        """[B, S, V] logits of `mb` (no grad); r2 records the policy's routing on `mb`."""
        model, ctl = (self.reference, self.ref_replay) if reference else (self.model,
                                                                          self.replay)
        rows = self._rows(mb, mode)
        record = mode == ReplayMode.R2 and not reference
        if ctl is not None:
            drive(ctl, rows, record)
        self.agreement.valid_T = self.agreement.mine(mb.valid_rows_BS.reshape(-1))
        self.current = mb
        out = self._logits(model, mb)
        if not reference:
            self.agreement.collect(mb)
        if ctl is not None and record and rows is None:
            mb.replay_rows = compact_ids(ctl.recorded() if self.sp == 1 else [
                gather_rows(r, self.sp_group, self.sp) for r in ctl.recorded()], self.num_experts)
        if ctl is not None:
            ctl.end_step()
        return out

    def microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Packed (hf.packing) or padded micro-batches, on this rank's device."""
        d = self.cfg.data
        cut = pack_microbatches if self.hf.packing else split_microbatches
        pad = math.lcm(d.pad_multiple, self.sp)  # every rank of a group takes 1/P of a row
        if self.sp > 1:  # the group's ranks train the same rows
            samples = group_samples(list(samples), self.sp_group, self.sp, self.sp_rank)
        mbs = cut(samples, d.micro_batch_size, pad, self.device)
        if self.sharded:  # every forward gathers parameters: as many on every rank
            n = max_over_ranks(len(mbs))
            self.padded = n - len(mbs)
            mbs += [filler_microbatch(pad, len(self.moe_layers), self.top_k)
                    for _ in range(self.padded)]
        return [mb.to(self.device) for mb in mbs]

    def update(self, mbs: Sequence[MicroBatch], mode: ReplayMode, loss_fn: LossFn) -> float:
        """Forward/backward over `mbs` + clip + AdamW; returns the (global) grad norm. The step
        is taken only if every rank's loss and the grad norm are finite (one vote): otherwise
        PeerFault on every rank and nothing is applied."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stage(mbs, mode)
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        try:
            for i, mb in enumerate(mbs):
                self.current = mb
                if self.sharded and self.hf.unsharded_grad_accumulation:  # one reduce-scatter
                    self.model.set_requires_gradient_sync(i == len(mbs) - 1)
                drive(self.replay, self._rows(mb, mode), record=False)
                loss = loss_fn(mb, self._logits(self.model, mb))
                finite &= torch.isfinite(loss.detach()).all()
                (loss * self.sp if self.sp > 1 else loss).backward()
                self.replay.end_step()
        finally:
            self.replay.end_step()
        self.current = None
        clip = self.cfg.optim.clip_grad or float("inf")
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        ok = bool(finite) and np.isfinite(norm)
        try:
            checkpoint(Level.OK if ok else Level.DATA)
        except PeerFault:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        return norm

    # ------------------------------------------------------------------ weights
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named full weights on rank 0, {} on the others (collective under FSDP2:
        every rank must call it; one parameter is gathered at a time)."""
        dtype = torch.bfloat16 if model_section(self.cfg).dtype == "bf16" else torch.float32
        if not self.sharded:
            return export_hf(self.model, dtype)
        return {k: v.detach().clone() for k, v in iter_export_hf(self.model, dtype, sender=0)}

    def iter_hf_weights(self, sender: int = 0, chunk_bytes: int = 256 << 20,
                        wire: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named weights streamed to rank `sender`: one parameter gathered at a
        time (FSDP2's gather is per parameter; `chunk_bytes` and `wire` do not apply: the
        tensors come one by one)."""
        dtype = torch.bfloat16 if model_section(self.cfg).dtype == "bf16" else torch.float32
        return iter_export_hf(self.model, dtype, sender)

    def checkpoint_state(self) -> tuple[Any, Any]:
        """(model + optimizer as one DCP state: sharded, resharded on load, the optimizer)."""
        return HFTrainState(self.model, self.optimizer), self.optimizer


class HFTrainState(ShardedState):
    """Policy parameters and AdamW state as DCP saves them: this rank's FSDP2 shards (DTensors),
    loaded back onto any world size (torch.distributed.checkpoint.state_dict)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
