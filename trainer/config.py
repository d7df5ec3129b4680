"""TrainerConfig: every knob of `r3flow train`, validated at boot (unknown keys are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from pydantic import Field, model_validator

from services.common.auth import ClientAuthConfig
from services.common.config import StrictConfig
from services.common.staleness import DEFAULT_MAX_POLICY_LAG, MaxPolicyLag
from services.common.weight_sync.config import WeightSyncConfig
from trainer.hooks import HookConfig
from trainer.loop.tracking import TrackingConfig
from trainer.losses.loss_config import LossConfig
from trainer.lr_schedule import learning_rate
from trainer.ranks.ray_config import RayLaunchConfig
from trainer.registry import Section, check_backend
from trainer.replay import ReplayMode

# The backends' sections (trainer.registry: each backend's config module declares its own). They
# are typed Any here; the backends read them through typed accessors (trainer.megatron.config.
# model_section, trainer.hf.config.hf_section), this module and the planner (trainer.plan,
# which imports no backend either) through `ModelSection` and `HFSection`.
HF_SECTION, MODEL_SECTION = Section("hf"), Section("model")


class ModelSection(Protocol):
    """What the neutral core and the planner read of the `model` section (trainer.megatron.config.ModelConfig,
    which mypy checks against this there)."""

    @property
    def dtype(self) -> Literal["fp32", "bf16"]: ...
    @property
    def experts(self) -> str: ...
    @property
    def attention(self) -> Literal["auto", "unfused", "sdpa"]: ...
    @property
    def planned_dispatch(self) -> bool | str: ...
    @property
    def batch_first_logits(self) -> bool | str: ...
    @property
    def moe_permute(self) -> str: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...
    @property
    def context_parallel(self) -> int: ...
    @property
    def expert_parallel(self) -> int: ...
    @property
    def expert_tensor_parallel(self) -> int: ...
    @property
    def recompute(self) -> str: ...
    @property
    def recomputes_router(self) -> bool: ...
    @property
    def recompute_set(self) -> bool: ...
    def fast_path(self, cuda: bool, family: str | None = None) -> ModelSection: ...


class HFSection(Protocol):
    """What the planner reads of the `hf` section (trainer.hf.config.HFBackendConfig, which mypy
    checks against this there)."""

    @property
    def sharding(self) -> str: ...
    @property
    def shard_group_size(self) -> int: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def attn_implementation(self) -> str: ...


class OptimConfig(StrictConfig):
    """Adam through megatron's get_megatron_optimizer."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate (the schedule scales it)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="lr after the warmup (trainer.lr_schedule): constant = lr; "
        "cosine = from lr down to min_lr over decay_steps")
    warmup_steps: int = Field(
        0, ge=0, description="linear warmup: step s (0-based) of the first warmup_steps runs at "
        "lr x (s + 1) / warmup_steps; 0 = none")
    decay_steps: int | None = Field(
        None, ge=1, description="cosine: steps of the decay after the warmup (min_lr after "
        "them); None = run.steps - warmup_steps (needs run.steps > warmup_steps)")
    min_lr: float = Field(0.0, ge=0, description="cosine: the lr at the end of the decay")
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0, description="global grad-norm clip (0 = off)")
    use_distributed_optimizer: bool = Field(
        False, description="shard Adam state and fp32 main weights over the data-parallel ranks "
        "(megatron-core DistributedOptimizer: grads reduce-scattered, params all-gathered)")
    overlap_grad_reduce: bool = Field(
        False, description="megatron DDP: reduce gradient buckets during backward, as they fill "
        "(DistributedDataParallelConfig.overlap_grad_reduce), instead of after it")
    overlap_param_gather: bool = Field(
        False, description="megatron DDP with the distributed optimizer: all-gather the updated "
        "parameters bucket by bucket during the next forward (pre-hooks on every module; "
        "DistributedDataParallelConfig.overlap_param_gather) instead of at the end of the "
        "optimizer step; export, weight push and checkpoint finish the gather first. Needs "
        "use_distributed_optimizer and overlap_grad_reduce (without it megatron makes one "
        "bucket: nothing to overlap)")
    param_gather_dispatch: Literal["forward", "step"] = Field(
        "forward", description="with overlap_param_gather, when the gathers start: forward = "
        "megatron's chain (the first layer's pre-hook starts its bucket's gather, each finished "
        "bucket the next: one in flight); step = every bucket's right after the optimizer step, "
        "in forward order (they also overlap the host work before the next forward)")
    ddp_bucket_size: int | None = Field(
        None, ge=1, description="megatron DDP: parameters per grad-reduce / param-gather bucket "
        "(DistributedDataParallelConfig.bucket_size) when overlap_grad_reduce is on; None = "
        "megatron's default, max(40M, 1M x DP size)")
    fused_adam: bool | Literal["auto"] = Field(
        "auto", description="run torch's AdamW as its fused multi-tensor kernel (fused=True; "
        "megatron-core falls back to torch.optim.AdamW without TransformerEngine/Apex); auto = "
        "on on CUDA with model.dtype bf16, off otherwise (TrainerConfig.fast_path)")
    ppo_epochs: int = Field(1, ge=1, description="passes of PPO updates over each GRPO batch")
    mini_batches: int = Field(
        1, ge=1, description="optimizer updates per pass (the batch's micro-batches split "
        "between them); ppo_epochs * mini_batches updates per step, one policy version")

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr: {self.min_lr} above optim.lr {self.lr}")
        return self

    @model_validator(mode="after")
    def _overlap_param_gather(self) -> OptimConfig:
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("optim.overlap_param_gather: needs optim.use_distributed_optimizer "
                             "(without it no parameter is all-gathered after the step)")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("optim.overlap_param_gather: needs optim.overlap_grad_reduce "
                             "(without it megatron DDP makes one bucket, gathered whole before "
                             "the first layer: nothing would overlap)")
        if self.param_gather_dispatch != "forward" and not self.overlap_param_gather:
            raise ValueError("optim.param_gather_dispatch: step needs optim.overlap_param_gather")
        if self.ddp_bucket_size is not None and not self.overlap_grad_reduce:
            raise ValueError("optim.ddp_bucket_size: needs optim.overlap_grad_reduce (without "
                             "it megatron DDP makes one bucket whatever the size)")
        return self


class ReplayConfig(StrictConfig):
    """Routing replay and its runtime check."""

    mode: ReplayMode = Field(ReplayMode.R3, description="r3 | r2 | off")
    agreement_floor: float = Field(
        0.5, ge=0, le=1, description="floor of the routing agreement (fraction of replayed ids "
        "the trainer's router also picks), judged per (trajectory unit, MoE layer): each "
        "trajectory's prompt rows and each segment's rows, on every MoE layer separately. A "
        "unit below it quarantines its group; how the number reads: agreement_floor_kind")
    agreement_floor_kind: Literal["absolute", "over_chance"] = Field(
        "absolute", description="absolute: agreement_floor is the floor itself; over_chance: "
        "it is the fraction of the way from chance (top_k/num_experts, what random ids read) "
        "to 1, floor = c + agreement_floor * (1 - c), so one setting means the same for 8 and "
        "128 experts")
    agreement_min_ids: int = Field(
        8, ge=1, description="a (unit, MoE layer) cell is judged alone only when it holds at "
        "least this many replayed ids (tokens x top_k); a unit whose cells are smaller is judged on "
        "them pooled over the MoE layers, and every cell counts in its layer's batch agreement")
    check_agreement: bool = Field(True, description="compute and enforce routing agreement")
    compare_off: bool = Field(
        False, description="also compute the batch's logprobs with natural routing and log "
        "logprob_diff_mean_off / _max_off / _far_share_off and mismatch_kl_off (one extra "
        "forward pass per step)")
    compare_off_every: int = Field(
        1, ge=1, description="with compare_off: run that pass on the step to every N-th "
        "policy version only (step 1 of a fresh run included; 1 = every step); the other "
        "steps log no *_off keys")

    def floor(self, top_k: int, num_experts: int) -> float:
        """The absolute agreement floor of a (unit, MoE layer) cell for this model."""
        if self.agreement_floor_kind == "absolute":
            return self.agreement_floor
        chance = top_k / num_experts
        return chance + self.agreement_floor * (1 - chance)


class DataConfig(StrictConfig):
    """Where batches come from and how they are cut."""

    store: str = Field("127.0.0.1:50051", description="TrajectoryStore gRPC address")
    store_auth: ClientAuthConfig = Field(
        default_factory=ClientAuthConfig,  # type: ignore[arg-type]
        description="TLS CA, client cert and the trainer role's token file for the store")
    consumer: str = Field("trainer-0", description="consumer name for pull/ack")
    groups_per_step: int = Field(4, ge=1, description="GRPO groups per optimizer step")
    lease_seconds: int = Field(120, ge=1, description="un-acked groups are redelivered after this")
    wait_ms: int = Field(2000, ge=0, description="how long one pull waits for ready groups")
    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    pad_multiple: int = Field(8, ge=1, description="sequence length padding multiple")
    old_logprobs: Literal["trainer", "rollout"] = Field(
        "trainer", description="PPO ratio denominator: the trainer's old-policy pass "
        "(standard) or the rollout engine's sampled-token logprobs")
    max_policy_lag: MaxPolicyLag = Field(
        DEFAULT_MAX_POLICY_LAG, description="drop at intake every group whose oldest segment's policy "
        "version lags the trainer's by more than this (acked to the store as dropped `stale`, "
        "counted in r3flow_trainer_groups_stale_total, never trained); the trainer's version "
        "moves at every update. Set it to the store's max_policy_lag; None = no check here "
        "(the store's drop at delivery only)")
    correct_reward: float = Field(
        1.0, description="a trajectory counts as correct (the step's `accuracy`, the evals' "
        "accuracy and pass@k) when its reward is at least this (the built-in verifiers give 1 "
        "for a right answer)")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: a pulled group whose rewards are all equal "
        "(no advantage, no policy gradient) is acked as dropped and the batch refilled from the "
        "store")
    dynamic_sampling_max_pulls: int = Field(
        4, ge=1, description="a step inspects at most this many x groups_per_step groups; past "
        "that, equal-reward groups fill the batch (a task the policy always or never solves "
        "would otherwise stall training)")


class RunConfig(StrictConfig):
    """Run bookkeeping."""

    run_dir: str = Field("runs/train", description="checkpoints and the JSONL run log")
    steps: int = Field(10, ge=0, description="optimizer steps to take (0 = until stopped)")
    checkpoint_every: int = Field(5, ge=1, description="save a checkpoint every N steps")
    async_checkpoint: bool = Field(
        False, description="write checkpoints in the background: the step boundary only copies "
        "the rank's weights and optimizer state to host memory, a thread writes the files and "
        "the checkpoint is published (meta.json, latest; the store acked) at a later boundary "
        "once every rank's files are written; a kill mid-write resumes from the last complete "
        "one (trainer.checkpoint)")
    keep_checkpoints: int = Field(
        3, ge=0, description="keep the newest N checkpoints, deleting older ones after each "
        "save (never the latest or the one this run resumed from); 0 = keep all")
    hf_export_every: int = Field(
        0, ge=0, description="write the full weights in HF format (safetensors + config + "
        "tokenizer, what vLLM and transformers load) to <run_dir>/hf/step-N every N steps and "
        "point <run_dir>/hf/latest at it (trainer.hf_export); 0 = never")
    hf_keep: int = Field(
        2, ge=0, description="keep the newest N HF exports, deleting older ones after each "
        "export (never the one hf/latest names); 0 = keep all")
    metrics_host: str = Field(
        "127.0.0.1", description="where /metrics listens; 0.0.0.0 on a cluster (a Ray trainer "
        "refuses loopback there: Prometheus could not scrape it)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port (0 = any free)")
    metrics_linger_s: float = Field(
        0.0, ge=0, le=600, description="after the last step, keep serving /metrics this long "
        "(a short job's final values reach a scraper; SIGTERM ends it early)")
    sample_rows: int = Field(
        4, ge=0, description="per step, this many trained groups' first trajectory (prompt, "
        "response, reward) appended to <run_dir>/samples.jsonl; 0 = none")
    peak_tflops: float | None = Field(
        None, gt=0, description="one trainer device's peak TFLOP/s for the step's `mfu`; None "
        "= the CUDA device's bf16 dense peak when known (trainer.loop.batch_stats), else no MFU")
    eval_log: str | None = Field(
        None, description="the rollout workers' eval.log (held-out accuracy and pass@k, "
        "services.rollout.evaluation) when this process can read it: each step's log record "
        "and trackers get the rows written since the last step (trainer.loop.eval_feed)")
    push_weights_every: int = Field(1, ge=0, description="weight push every N steps (0 = never)")
    exit_engine_wait_s: float = Field(
        30.0, ge=0, le=600, description="at exit, wait at most this long for every registered "
        "engine to report the last pushed version (so none polls a gone rendezvous store)")
    launcher: Literal["local", "ray"] = Field(
        "local", description="local: one in-process rank; ray: one Ray actor per device")
    world_size: int = Field(1, ge=1, description="trainer ranks (ray launcher)")
    store_ready_timeout_s: float = Field(60.0, gt=0, description="wait for the store at start")


class TrainerConfig(StrictConfig):
    """`r3flow train --config FILE`."""

    backend: Literal["megatron", "hf"] = Field(
        "megatron", description="megatron: megatron-core GPTModel (trainer.megatron); hf: HF "
        "transformers + FSDP2 (trainer.hf, docs/hf_backend.md)")
    hf: Annotated[Any, HF_SECTION] = Field(
        default_factory=HF_SECTION.default, description="knobs of the hf backend only "
        "(trainer.hf.config.HFBackendConfig)")
    model_dir: str = Field("", description="HF checkpoint directory (Qwen3-MoE)")
    drop_mtp: bool = Field(False, description="train a checkpoint that has multi-token-prediction "
                           "layers (HF num_nextn_predict_layers > 0: DeepSeek-V3, GLM-4.5) "
                           "without them: they are neither trained nor exported (transformers "
                           "and vLLM's main model do not load them either). r3flow does not "
                           "train MTP; without this such a checkpoint is refused at boot")
    model: Annotated[Any, MODEL_SECTION] = Field(
        default_factory=MODEL_SECTION.default, description="how the model is built and "
        "sharded (trainer.megatron.config.ModelConfig; the hf backend reads dtype and "
        "router_dtype and needs expert_parallel 1)")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="weight push to the rollout engines")
    ray: RayLaunchConfig = Field(
        default_factory=RayLaunchConfig,  # type: ignore[arg-type]
        description="ray launcher: cluster to join, rank placement")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="step metrics to TensorBoard (default), "
        "W&B, MLflow (trainer.loop.tracking)")
    hooks: list[HookConfig] = Field(
        default_factory=list, description="step hooks the loop consults before every step "
        "(trainer.hooks: 'module.path:factory' or {path, options}; they may scale the step's "
        "lr or end the run); imported in the loop's process at start")

    def fast_path(self, cuda: bool, family: str | None = None) -> TrainerConfig:
        """`self` with every `auto` fast-path switch decided (idempotent; the backends call it
        at start with the device they run on, `r3flow plan` with the pods' device): grouped
        experts, SDPA, planned dispatch (ModelConfig.fast_path), fused Adam and the chunked
        log-softmax on CUDA with model.dtype bf16 (its Triton kernels where it runs on CUDA);
        the reference path on CPU or in fp32.
        Explicit settings are kept (the equality tests set the reference path)."""
        model: ModelSection = self.model
        fast = cuda and model.dtype == "bf16"
        update: dict[str, Any] = {"model": model.fast_path(cuda, family)}
        if self.optim.fused_adam == "auto":
            update["optim"] = self.optim.model_copy(update={"fused_adam": fast})
        loss = self.loss
        if loss.chunked_logprobs == "auto":
            loss = loss.model_copy(update={"chunked_logprobs": fast})
        if loss.logprob_kernel == "auto":  # Triton ships with torch's CUDA builds
            loss = loss.model_copy(update={"logprob_kernel": "triton" if cuda and
                                           loss.chunked_logprobs is True else "torch"})
        update["loss"] = loss
        return self.model_copy(update=update)

    def describe_path(self) -> str:
        """One line naming the trainer path (after fast_path()): `fast` when every switch that
        applies to the backend is on, `reference` when all are off, else `mixed`."""
        m: ModelSection = self.model
        if self.backend == "hf":
            switches = {"chunked_logprobs": self.loss.chunked_logprobs}
        else:
            switches = {"experts": m.experts == "grouped", "attention": m.attention == "sdpa",
                        "planned_dispatch": m.planned_dispatch is True,
                        "fused_adam": self.optim.fused_adam is True,
                        "chunked_logprobs": self.loss.chunked_logprobs is True}
        on = [k for k, v in switches.items() if v]
        kind = "fast" if len(on) == len(switches) else "reference" if not on else "mixed"
        return (f"trainer path: {kind} (backend {self.backend}, dtype {m.dtype}; experts "
                f"{m.experts}, attention {m.attention}, planned_dispatch {m.planned_dispatch}, "
                f"batch_first_logits {m.batch_first_logits}, moe_permute {m.moe_permute}, fused_adam {self.optim.fused_adam}, chunked_logprobs "
                f"{self.loss.chunked_logprobs}, logprob_kernel {self.loss.logprob_kernel})")

    def old_pass_refusal(self, mode: str) -> str | None:
        """Why the old-policy pass cannot be skipped for a step in replay `mode` (None: it
        can; loss.skip_old_policy_pass, trainer.grpo)."""
        loss, m = self.loss, self.model
        if self.optim.ppo_epochs * self.optim.mini_batches != 1:
            return "needs one update per batch (optim.ppo_epochs 1, optim.mini_batches 1)"
        if loss.kl_in == "reward" and loss.kl_coef > 0:
            return "kl_in reward shapes the advantages with the old policy's KL before the update"
        if loss.rollout_correction.mask_level != "off":
            return ("rollout_correction.mask_level: MIS masks tokens out of the update's "
                    "normaliser before the update")
        if getattr(m, "pipeline_parallel", 1) > 1:
            return "model.pipeline_parallel > 1: the update's logprobs exist on the last stage only"
        if self.backend == "hf" and mode == "r3" and self.replay.check_agreement:
            return "backend hf: its update pass does not check the routing agreement"
        recomputes = getattr(m, "recomputes_router", False) if self.backend == "megatron" \
            else getattr(self.hf, "gradient_checkpointing", False)
        if mode == "r2" and recomputes:
            return ("r2 with MoE recompute: the backward recompute would route again instead of "
                    "replaying the forward's own routing")
        return None

    @model_validator(mode="after")
    def _skip_old_pass(self) -> TrainerConfig:
        why = self.loss.skip_old_policy_pass == "on" and self.old_pass_refusal(self.replay.mode)
        if why:
            raise ValueError(f"loss.skip_old_policy_pass: on does not apply: {why}")
        return self

    @model_validator(mode="after")
    def _rollout_correction_source(self) -> TrainerConfig:
        if self.loss.rollout_correction.enabled and self.data.old_logprobs != "trainer":
            raise ValueError("loss.rollout_correction: TIS/MIS weigh the trainer's old-policy "
                             "logprobs against the rollout's; set data.old_logprobs: trainer")
        return self

    @model_validator(mode="after")
    def _cosine_length(self) -> TrainerConfig:
        o = self.optim
        if o.lr_schedule == "cosine" and o.decay_steps is None and \
                self.run.steps <= o.warmup_steps:
            raise ValueError(f"optim.decay_steps: cosine needs it when run.steps ({self.run.steps}"
                             f") is not above optim.warmup_steps ({o.warmup_steps})")
        return self

    def learning_rate(self, step: int) -> float:
        """The lr of the step taken after `step` completed steps (trainer.lr_schedule)."""
        return learning_rate(self.optim, step, self.run.steps)

    @model_validator(mode="after")
    def _launcher_world(self) -> TrainerConfig:
        if self.run.launcher == "local" and self.run.world_size != 1:
            raise ValueError("run.world_size: the local launcher runs exactly 1 rank (use ray)")
        check_backend(self)
        return self
