"""MegatronBackend (trainer.backend.TrainBackend): policy (+ frozen reference) megatron models,
megatron DDP + Adam and native RouterReplay on this rank; the step itself is trainer.grpo's.

Parallel layout (model.* sizes, trainer.megatron.parallel): the ranks of one model replica
(TP x PP) train the union of the samples the loop gave them; each rank replays only its
pipeline stage's MoE layers at the sequence positions its routers see (SP slice); pipeline
no-grad passes run through the schedule and broadcast the last stage's logits; the routing
agreement is merged over the replica's ranks before it is judged.
Micro-batches are padded [B, S] and as many on every rank (filler ones on the less busy ranks).
An update is megatron's forward_backward_func over the micro-batches (replay per micro-batch,
FIFO REPLAY_BACKWARD when MoE activations are recomputed), grad clip + Adam; ids cleared. Every
replaying forward (r3 and r2) checks that the experts used are the replayed ids, and the
agreement floor is checked again before the optimizer step. Two vote points (trainer.guard)
keep the ranks together: before the grad reduction (a peer's fault in its forward/backward)
and before the optimizer step (a non-finite loss or gradient on any rank skips the step on
every rank).
With model.planned_dispatch each r3/r2 pass first plans its MoE all-to-all split sizes from the
replayed ids (trainer.megatron.planned_dispatch: one gather, one host copy per pass).
Replay ids stay in their compact dtype on the device (the codec's uint8/uint16 for r3, the same
for r2's recorded ids) and are widened to the routers' int64 for one micro-batch's forward at a
time: its recompute replays that very tensor (RouterReplay's queue) and nothing keeps it after,
so a pass holds the int64 ids of the micro-batches in flight (one without pipelining), not all.
Legend: B batch rows, S sequence, V vocabulary, T router rows (S*B), K top-k.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from services.common.weight_sync import buckets as bk
from trainer.config import TrainerConfig
from trainer.guard import Level, checkpoint, vote_on
from trainer.megatron.config import model_section
from trainer.megatron.cpu_shims import cuda_tensor_type_names
from trainer.megatron.export_stream import HFStream
from trainer.megatron.hf_mapping import gather_experts, load_arch, megatron_to_hf
from trainer.megatron.model import (
    BuiltModel,
    build_model,
    init_parallel,
    resolve_router_dtype,
)
from trainer.megatron.parallel import (
    check_layout,
    describe,
    gather_full,
    local_positions,
    model_parallel_group,
)
from trainer.megatron.param_gather import dispatch_at_step, finish_param_gather, start_param_gather
from trainer.megatron.planned_dispatch import StepPlan, planned_layers, tokens_per_expert
from trainer.megatron.replay import AgreementMonitor, ModelReplay
from trainer.megatron.weights import MegatronWeights
from trainer.protocol import LossFn
from trainer.ranks.collectives import max_over_ranks
from trainer.replay import ReplayMode, drive
from trainer.samples.alignment import check_routes, local_routing, to_router_rows
from trainer.samples.batch import (
    MicroBatch,
    Sample,
    compact_ids,
    filler_microbatch,
    routed_ids,
    split_microbatches,
)

log = logging.getLogger(__name__)


def _optimizer(built: BuiltModel, cfg: TrainerConfig):
    """Wrap in megatron DDP and build Adam (get_megatron_optimizer); with
    optim.use_distributed_optimizer its state and the fp32 main weights are sharded over the
    data-parallel ranks (grads reduce-scattered, parameters all-gathered after the step, or with
    optim.overlap_param_gather later: trainer.megatron.param_gather)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16, o = model_section(cfg).dtype == "bf16", cfg.optim
    dist_opt = o.use_distributed_optimizer
    ddp = DDP(built.config, DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True,
        overlap_grad_reduce=o.overlap_grad_reduce, overlap_param_gather=o.overlap_param_gather,
        bucket_size=o.ddp_bucket_size), built.module)
    with cuda_tensor_type_names():  # no-op on GPUs
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
            use_distributed_optimizer=dist_opt, overlap_param_gather=o.overlap_param_gather,
            params_dtype=torch.bfloat16 if bf16 else torch.float32), [ddp])
    built.config.no_sync_func = ddp.no_sync
    if o.overlap_param_gather and o.param_gather_dispatch == "step":
        dispatch_at_step(ddp)
    if o.fused_adam:
        fuse_adam(opt)
    return ddp, opt


def fuse_adam(opt: Any) -> None:
    """Switch the torch AdamW(s) megatron built (no TransformerEngine/Apex here) to their fused
    kernel: the param groups' documented `fused` option, read at every step()."""
    for inner in getattr(opt, "chained_optimizers", [opt]):
        torch_opt = inner.optimizer
        if not isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW):
            raise ValueError(f"optim.fused_adam: megatron built {type(torch_opt).__name__}, not "
                             "torch's Adam/AdamW")
        for group in torch_opt.param_groups:
            group["fused"], group["foreach"] = True, False


class MegatronBackend:
    """Policy model + optimizer + replay on this rank (process groups initialised here)."""

    def __init__(self, cfg: TrainerConfig) -> None:
        if not cfg.model_dir:
            raise ValueError("model_dir: an HF checkpoint directory is required")
        model_cfg = model_section(cfg)
        init_parallel(model_cfg)
        arch = load_arch(cfg.model_dir)
        self.data_parallel_size = check_layout(model_cfg, torch.distributed.get_world_size(), arch,
                                               cfg.data.pad_multiple)
        # `auto` settings resolved against the checkpoint and this rank's device, so self.cfg
        # says what runs (the fast path on CUDA bf16, the reference on CPU / fp32).
        cfg = cfg.fast_path(torch.cuda.is_available(), arch.family)
        model_cfg = resolve_router_dtype(model_section(cfg), arch.family)
        cfg = cfg.model_copy(update={"model": model_cfg})
        log.info("%s", cfg.describe_path())
        log.info("resolved model config: %s; %s", model_cfg.model_dump_json(),
                 describe(model_cfg, torch.distributed.get_world_size()))
        self.cfg = cfg
        self.policy = build_model(cfg.model_dir, model_cfg)
        self.arch = self.policy.arch
        self.moe_layers, self.num_experts, self.top_k = (
            tuple(self.arch.moe_layers), self.arch.num_experts, self.arch.top_k)
        recompute = model_cfg.recomputes_router
        self.replay = ModelReplay(self.policy.replays, recompute)
        # this stage's MoE layers: routing rows of other stages' layers are dropped
        self.stage_columns = [self.moe_layers.index(h) for h in self.policy.moe_layers]
        self.agreement = AgreementMonitor(self.policy.routers, self.policy.moe_layers,
                                          self.arch.top_k, recompute, model_parallel_group())
        self.ddp, self.optimizer = _optimizer(self.policy, cfg)
        self.policy.config.finalize_model_grads_func = self._finalize_grads  # vote, reduce
        self.current: MicroBatch | None = None  # in a forward/backward now (fault blame)
        self._finite = torch.ones((), dtype=torch.bool)
        self.reference: BuiltModel | None = None
        if cfg.loss.uses_reference:  # built after the policy: it owns its own replay instances
            self.reference = build_model(cfg.model_dir, model_cfg)
            self.reference.module.requires_grad_(False)
            self.ref_replay = ModelReplay(self.reference.replays, recompute=False)
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        self.padded = 0  # filler micro-batches of the last `microbatches` call
        self._pass_plan: StepPlan | None = None  # model.planned_dispatch: the running pass's
        self._streams: dict[tuple[int, int, str | None], HFStream] = {}  # per iter_hf_weights key

    def microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Padded micro-batches of `samples`, as many on every rank (collective: every rank
        calls it in every pass). Ranks hold different sample counts (groups of different sizes,
        partial releases, quarantined groups) and every forward is an EP all-to-all and every
        update a DP grad reduction, so a rank with fewer pads up to the most with micro-batches
        that train nothing (`filler_microbatch`); `padded` counts them."""
        d = self.cfg.data
        mbs = split_microbatches(model_parallel_samples(samples), d.micro_batch_size,
                                 d.pad_multiple, self.device)
        n = max_over_ranks(len(mbs))
        self.padded = n - len(mbs)
        if self.padded:
            log.info("%d micro-batches padded to the %d of the busiest rank", len(mbs), n)
        mbs += [filler_microbatch(d.pad_multiple, len(self.arch.moe_layers), self.arch.top_k)
                for _ in range(self.padded)]
        return [mb.to(self.device) for mb in mbs]

    # ------------------------------------------------------------------ routing
    def _positions(self, mb: MicroBatch) -> torch.Tensor:
        """Sequence positions of `mb` this rank's routers see (SP/CP shard)."""
        return local_positions(int(mb.tokens_BS.shape[1]), model_section(self.cfg).sequence_parallel)

    def _local_ids(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """r3: `mb`'s rollout routing this rank replays (its stage's MoE layers, its sequence
        shard; codec dtype) and their valid flags."""
        if mb.routing_BSLK is None:
            raise ValueError("replay.mode: r3 needs rollout routing on every sample")
        return local_routing(mb.routing_BSLK, mb.valid_rows_BS, self.stage_columns,
                             self._positions(mb))

    def _rows(self, mb: MicroBatch, mode: ReplayMode) -> list[torch.Tensor] | None:
        """This rank's replay ids of `mb`, widened to int64 for one forward ([T, K] per MoE layer
        of its stage, its sequence shard); the caller's forward (and its recompute) holds them."""
        if mode == ReplayMode.R3:
            return to_router_rows(self._local_ids(mb)[0])
        if mode == ReplayMode.R2 and mb.replay_rows is not None:
            return [t.long() for t in mb.replay_rows]
        return None

    def _check(self, mb: MicroBatch, mode: ReplayMode, count: bool) -> torch.Tensor | None:
        """Check `mb`'s replay ids before the pass (r3: the routing rules) and, when `count`,
        their tokens per expert for the dispatch plan; the int64 ids are dropped here."""
        if mode == ReplayMode.R3:
            ids_BSLK, valid_BS = self._local_ids(mb)
            check_routes(routed_ids(ids_BSLK), valid_BS, self.arch.num_experts,
                         self.policy.moe_layers, self.arch.top_k)
        rows = self._rows(mb, mode) if count else None
        return None if rows is None else tokens_per_expert(rows, self.num_experts, self.device)

    def _replay_rows(self, mb: MicroBatch, mode: ReplayMode) -> list[torch.Tensor] | None:
        """`_rows` of the forward about to run, bound to the pass's dispatch plan."""
        rows = self._rows(mb, mode)
        if rows is not None and self._pass_plan is not None:
            self._pass_plan.bind(mb, rows)
        return rows

    def _logits(self, module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return module(input_ids=mb.tokens_BS, position_ids=mb.position_ids_BS,
                      attention_mask=None)

    def _pipeline_logits(self, module: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """No-grad forward through the pipeline schedule; the last stage's [B, S, V] logits are
        broadcast to every stage (each rank computes the same logprobs)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iter, model):
            return self._logits(model, next(data_iter)), lambda out, non_loss_data=True: out

        b, s = (int(x) for x in mb.tokens_BS.shape)
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([mb]), model=[module],
            num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
            collect_non_loss_data=True)
        dtype = torch.bfloat16 if model_section(self.cfg).dtype == "bf16" else torch.float32
        logits = out[0].contiguous() if ps.is_pipeline_last_stage() else torch.empty(
            b, s, self.arch.vocab_size, dtype=dtype, device=self.device)
        dist.broadcast(logits, ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return logits

    # ------------------------------------------------------------------ dispatch plan
    def _plan(self, model: BuiltModel, mbs: Sequence[MicroBatch],
              mode: ReplayMode) -> StepPlan | None:
        """The pass's replay ids, checked on every rank before any collective of the pass
        (guard.vote_on: a rank whose routing is invalid votes there; its peers hear it instead
        of waiting in the plan's gather or the first all-to-all); with model.planned_dispatch
        under r3/r2, the all-to-all split sizes of every MoE layer of the pass from them
        (trainer.megatron.planned_dispatch; one gather over the tp_ep group, one host copy).
        Every rank of the group plans the same passes."""
        if mode == ReplayMode.OFF:
            return None
        layers = planned_layers(model.module)
        counts = vote_on(lambda: [self._check(mb, mode, bool(layers)) for mb in mbs])
        if not layers or all(c is None for c in counts):  # r2's recording pass: nothing to plan
            return None
        plan = StepPlan(counts, mbs, len(self.stage_columns), self.num_experts,
                        layers[0].token_dispatcher.tp_ep_group, self.device)
        for layer in layers:
            layer.plan = plan
        self._pass_plan = plan
        return plan

    def _unplan(self, model: BuiltModel, plan: StepPlan | None) -> None:
        """Drop the pass's plan; file its device-side checks with the agreement (no sync)."""
        for layer in planned_layers(model.module):
            layer.plan = None
        self._pass_plan = None
        if plan is not None:
            self.agreement.add_plan_checks(plan.checks())

    # ------------------------------------------------------------------ no-grad passes
    @contextmanager
    def no_grad_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode,
                     reference: bool) -> Iterator[None]:
        model = self.reference if reference else self.policy
        assert model is not None
        model.module.eval()
        plan = None
        try:
            plan = self._plan(model, mbs, mode)
            yield
        finally:
            self._unplan(model, plan)
            model.module.train()

    def logits(self, mb: MicroBatch, mode: ReplayMode, reference: bool = False) -> torch.Tensor:
        """[B, S, V] logits of `mb` (no grad); r2 records the policy's routing on `mb`."""
        model, ctl = (self.reference, self.ref_replay) if reference else (self.policy,
                                                                          self.replay)
        assert model is not None
        self.current = mb
        rows = self._replay_rows(mb, mode)
        record = mode == ReplayMode.R2 and not reference
        drive(ctl, rows, record)
        out = self._pipeline_logits(model.module, mb) if model_section(self.cfg).pipeline_parallel > 1 \
            else self._logits(model.module, mb)
        if not reference:
            self.agreement.collect(mb, self._positions(mb))
        if record and rows is None:
            mb.replay_rows = compact_ids(ctl.recorded(), self.num_experts)
        ctl.end_step()
        return out

    # ------------------------------------------------------------------ update
    def _forward_step(self, mode: ReplayMode, loss_fn: LossFn, n_mb: int, data_iter, model):
        mb = next(data_iter)
        self.current = mb
        drive(self.replay, self._replay_rows(mb, mode), record=False)
        logits = self._logits(model, mb)
        self.agreement.collect(mb, self._positions(mb))
        self.replay.after_forward()
        return logits, partial(self._schedule_loss, loss_fn, n_mb, mb)

    def _schedule_loss(self, loss_fn: LossFn, n_mb: int, mb: MicroBatch, logits: torch.Tensor):
        """megatron's schedule divides each micro-batch's loss by their count: undo it. Whether
        the loss is finite is kept for the vote before the optimizer step (no host sync)."""
        loss = loss_fn(mb, logits) * n_mb
        self._finite &= torch.isfinite(loss.detach()).all()
        return loss, {"loss": loss.detach()}

    def _finalize_grads(self, *args, **kwargs) -> None:
        """megatron's grad reduction, after a vote: a rank whose forward/backward raised (an
        OOM on one trajectory) is heard here instead of leaving its peers in the reduction."""
        from megatron.core.distributed import finalize_model_grads

        checkpoint(Level.OK)
        finalize_model_grads(*args, **kwargs)

    def _update_level(self) -> Level:
        """DATA when this rank's loss or (reduced) gradients are non-finite (a sum per grad
        buffer: an inf or NaN anywhere makes it non-finite, without a mask the buffer's size)."""
        finite = self._finite.clone()
        for buf in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            finite &= torch.isfinite(buf.grad_data.sum())
        return Level.OK if bool(finite) else Level.DATA

    def update(self, mbs: Sequence[MicroBatch], mode: ReplayMode, loss_fn: LossFn) -> float:
        """forward_backward_func over `mbs` + optimizer step; returns the grad norm. The step is
        taken only if every rank's loss and gradients are finite (megatron's optimizer checks
        only under an fp16 grad scaler): otherwise PeerFault on every rank, nothing applied."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        check = mode != ReplayMode.OFF and self.cfg.replay.check_agreement
        self.agreement.reset()
        self.agreement.enabled = check
        self._finite = torch.ones((), dtype=torch.bool, device=self.device)
        plan = None
        try:
            plan = self._plan(self.policy, mbs, mode)
            get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, mode, loss_fn, len(mbs)),
                data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
                seq_length=int(mbs[0].tokens_BS.shape[1]),
                micro_batch_size=int(mbs[0].tokens_BS.shape[0]), forward_only=False)
            self.current = None
            self._unplan(self.policy, plan)
            plan = None
            # Every rank finished its forward/backward: raising here strands no collective.
            self.agreement.check_recomputed()
            if check:
                self.agreement.check(self.cfg.replay.floor(self.top_k, self.num_experts),
                                     self.cfg.replay.agreement_min_ids)
            checkpoint(self._update_level())
            ok, grad_norm, _ = self.optimizer.step()
            if ok:
                start_param_gather(self.ddp)  # param_gather_dispatch: step (else a no-op)
        finally:
            self._unplan(self.policy, plan)
            self.replay.end_step()
            self.agreement.enabled = False
        if not ok:
            raise FloatingPointError("optimizer step skipped (non-finite gradients)")
        return float(grad_norm) if grad_norm is not None else float("nan")

    # ------------------------------------------------------------------ weights
    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (TP, PP and EP shards gathered; a collective)."""
        finish_param_gather(self.ddp)
        full = gather_full(self.policy.module, self.policy.config.gated_linear_unit)
        return {k: v.clone() for k, v in megatron_to_hf(gather_experts(full, self.arch),
                                                         self.arch).items()}

    def iter_hf_weights(self, sender: int = 0, chunk_bytes: int = 256 << 20,
                        wire: str | None = None) -> Iterable[Any]:
        """HF-named weights streamed to rank `sender`, unit by unit (export_stream.HFStream;
        its layout is worked out at the first push and kept: the parameters stay the same).
        With `wire` the sender gets whole packed buckets (its chunks) instead of tensors."""
        finish_param_gather(self.ddp)  # the stream reads the parameters, not a forward
        key = (sender, chunk_bytes, wire)
        if key not in self._streams:
            self._streams[key] = HFStream(
                self.policy.module, self.arch, self.policy.config.gated_linear_unit,
                sender=sender, chunk_bytes=chunk_bytes,
                wire=None if wire is None else bk.wire_dtype(wire))
        stream = self._streams[key]
        return stream if wire is None else stream.packed()

    def checkpoint_state(self) -> tuple[Any, Any]:
        """(the policy module, its optimizer); the parameters all-gathered first (save reads
        them whole; load overwrites them whole)."""
        finish_param_gather(self.ddp)
        return MegatronWeights(self.policy.module), self.optimizer


def model_parallel_samples(samples: Sequence[Sample]) -> list[Sample]:
    """The samples of this rank's model-parallel group (TP x PP): the union, in rank order, of
    the shares the loop gave its ranks, which split a step's groups over every rank as if all
    were data-parallel. Every rank of the group must run the same sequences (they hold slices of
    one model); this rank's own samples stay the same objects (callers map results by them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return list(samples)
    shares: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, list(samples), group=group)
    shares[dist.get_rank(group)] = list(samples)
    return [x for share in shares for x in share]
