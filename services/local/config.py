"""`r3flow local` configuration, and the component configs it renders for its children.

The children get exactly the config files a Kubernetes deployment would mount, written into the
run folder, so the local run exercises the same `r3flow store|rollout|train` commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from services.common import families
from services.common.config import StrictConfig
from services.common.tiny_moe import TinyMoeConfig
from services.local.tasks import TaskConfig
from trainer.hooks import HookConfig

if TYPE_CHECKING:
    from services.local.family import FamilyPlan


class GrpoConfig(StrictConfig):
    """The RL phase."""

    # 40 (was 80): `make run` under 10 minutes on a slow 2-core day (issue 46;
    # docs/benchmarks/local-run.md "make run on a slow box").
    steps: int = Field(40, ge=1, description="GRPO optimizer steps")
    group_size: int = Field(8, ge=2, description="samples per prompt (a GRPO group)")
    # 32 groups: the per-step reward is a mean over 32 prompts, so the first-5/last-5 comparison
    # is not at the mercy of which prompts a step drew (16 groups: last-5 means swung by ~0.1).
    groups_per_step: int = Field(32, ge=1, description="groups per optimizer step")
    max_tokens: int = Field(6, ge=1, description="generated tokens per sample")
    temperature: float = Field(1.0, gt=0)
    # 3e-4 for the 64-expert local model: at 1e-3 its ppo_kl was 0.04-0.26 a step and the clip
    # fraction 0.13-0.24 (the 8-expert model's 1e-3 gave a median of 8e-3); at 3e-4 ppo_kl is
    # within +-8e-3 and the reward still rises (BENCHMARKS.md "make run: r3 vs off").
    lr: float = Field(3e-4, gt=0)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    clip_grad: float = Field(1.0, ge=0, description="global grad-norm clip (0 = off)")
    ppo_epochs: int = Field(1, ge=1, description="passes of PPO updates over each batch")
    mini_batches: int = Field(1, ge=1, description="optimizer updates per pass over a batch")
    kl_coef: float = Field(0.0, ge=0, description="KL to the reference model (0 = no reference)")
    kl_metric: bool = Field(
        True, description="measure kl_ref (KL to the reference model) even at kl_coef 0: the "
        "dashboards' KL panel and the kl_ref column show it (one reference forward per step)")
    rollout_correction: Literal["off", "tis", "mis"] = Field(
        "off", description="tis: truncated importance sampling against the rollout policy "
        "(token level, threshold 2); mis: masked (tokens outside [0.5, 2]); both take the PPO "
        "ratio against the trainer's old-policy pass (old_logprobs trainer)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus (keeps the groups exploring)")
    adv_std_normalize: bool = Field(
        True, description="divide advantages by the group's reward std (GRPO; false: Dr. GRPO)")
    # Fully asynchronous with bounded staleness: rollouts run up to 3 versions ahead of the
    # trainer and the PPO ratio is taken against the rollout's own logprobs (the behaviour
    # policy), so ppo_kl and the clip fraction measure real off-policyness. Measured on the
    # 2-core box (8-expert model): lag 3 dropped 5.3% of produced trajectories as stale (lag 2:
    # 13.8%, lag 0: 37%) and the reward rose 0.48 -> 0.82 (BENCHMARKS.md, "Local run"); with
    # the 64-expert model and the backlog budget of store_config, lag 3 dropped none (seed 1).
    max_policy_lag: int = Field(
        3, ge=0, description="store drops groups older than this (0: strictly on-policy)")
    old_logprobs: Literal["trainer", "rollout"] = Field(
        "rollout", description="PPO ratio denominator: the trainer's old-policy pass, or the "
        "rollout engine's sampled-token logprobs (the behaviour policy of an async run)")
    backlog_steps: int = Field(2, ge=2, description="store backlog limit, in optimizer steps")
    lease_seconds: int = Field(
        120, ge=5, description="trainer lease: a crashed trainer's groups come back after it")
    weight_push_timeout_s: float = Field(
        120.0, gt=3, description="a push waits this long for a registered worker that is gone")
    dtype: Literal["fp32", "bf16"] = Field("bf16", description="trainer and engine dtype")
    compare_off: bool = Field(True, description="also measure |logprob diff| without replay")
    agreement_floor: float = Field(
        0.5, ge=0, le=1, description="the trainer's routing-agreement floor (trainer "
        "replay.agreement_floor: a unit below it quarantines its group, a whole MoE layer below "
        "it stops the run as misaligned); 0 measures the agreement without enforcing it")
    # The no-replay comparison and the reference pass were two of a step's four passes over
    # the batch (issue 46): measured on step 1 (the engine/trainer mismatch alone) and every
    # N-th step after it, they still draw both curves and the report's ratios, which pair
    # only the steps that measured both.
    measure_every: int = Field(
        4, ge=1, description="the no-replay comparison (|Δlogprob| off) and kl_ref on step 1 "
        "and every N-th step (trainer replay.compare_off_every, loss.kl_metric_every; 1 = "
        "every step)")
    micro_batch_size: int = Field(
        256, ge=1, description="trainer micro-batch (rows): a step's 256 short rows in one "
        "forward instead of 16 (the same update: the loss is normalised over the whole step)")
    checkpoint_every: int = Field(
        1, ge=1, description="trainer checkpoint every N steps (and at the end)")
    async_checkpoint: bool = Field(
        False, description="trainer run.async_checkpoint: checkpoints written in the "
        "background from a host snapshot (configs/local-gpu-h200.yaml)")
    hooks: list[HookConfig] = Field(
        default_factory=list, description="the trainer's step hooks (trainer config `hooks`, "
        "trainer.hooks): 'module.path:factory' or {path, options}, importable by the trainer")


class LocalEngineConfig(StrictConfig):
    """The rollout engines' knobs that differ between vLLM-CPU (the defaults) and a GPU run
    (configs/local-gpu-h200.yaml: CUDA graphs on, the GPU shared with the trainer)."""

    enforce_eager: bool = Field(
        True, description="no CUDA graphs (vLLM-CPU needs it); false on a GPU: graphs captured "
        "at engine start (rollout engine.enforce_eager)")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=0.98, description="share of the GPU the engine takes (vLLM-CPU ignores "
        "it); with the trainer on the same GPU, what the trainer does not need")
    max_num_seqs: int = Field(32, ge=1, description="engine batch size (sequences per step)")
    max_model_len: int = Field(64, ge=8, description="prompt + generated tokens")
    quantization: Literal["none", "fp8"] = Field(
        "none", description="rollout engine.quantization (fp8: vLLM's online FP8 against the "
        "bf16 trainer; GPU only)")


def local_model() -> TinyMoeConfig:
    """The MoE `r3flow local` trains: 64 experts, top-8, 4 MoE layers.

    TinyMoeConfig's own defaults (8 experts, top-2, 2 layers; what most tests build, for speed)
    have router margins so wide that hardly a routing decision differs between vLLM and the
    trainer: replay changed |Δlogprob| by 13% (ratio 0.87). With 64 experts top-8 over 4 layers
    the same batch at the same weights gives 1.84e-3 with replay against 2.79e-3 without (0.66,
    seed 0; BENCHMARKS.md "make run: r3 vs off")."""
    return TinyMoeConfig(num_experts=64, top_k=8, num_layers=4)


class LocalConfig(StrictConfig):
    """Everything `r3flow local` decides."""

    runs_dir: str = Field("runs", description="parent of the per-run folders")
    replay: Literal["r3", "r2", "off"] = "r3"
    family: str = Field(families.DEFAULT, description="MoE family of the tiny model (HF "
                        "model_type, one of services.common.families); it also decides the trainer "
                        "backend when trainer_backend is unset (services.local.family)")
    trainer_backend: Literal["megatron", "hf"] | None = Field(
        None, description="trainer backend; unset: megatron where it maps the family, else hf")
    workers: int = Field(1, ge=1, le=4, description="rollout worker processes")
    num_prompts: int | None = Field(
        None, ge=1, description="groups each rollout worker rolls out, then exits (None = until "
        "the run stops it)")
    seed: int = 0
    model: TinyMoeConfig = Field(
        default_factory=local_model, description="sizes of the MoE built for the run ({} = "
        "TinyMoeConfig's small defaults, as the tests use)")
    # Single-digit operands (100 problems) and a short warm start: GRPO starts at a mid-range
    # reward (~0.5) on a task it can measurably improve within 80 steps. Operands up to 19 with
    # 60 warm-start steps started at ~0.5 too but learnt slowly (gains 0.06-0.21 over 80 steps).
    task: TaskConfig = Field(default_factory=lambda: TaskConfig(max_operand=9))
    warm_start_steps: int = Field(12, ge=0, description="supervised steps before GRPO")
    warm_start_lr: float = Field(3e-3, gt=0)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    engine: LocalEngineConfig = Field(default_factory=LocalEngineConfig)
    trainer_launcher: Literal["local", "ray"] = Field("ray", description="ray: a Ray actor rank")
    timeout_s: float | None = Field(
        None, gt=0, description="the run's budget in seconds, fixed; unset: budget_boot_s + "
        "an allowance per step (services.local.budget.Budget), printed at start")
    # On the 2-core box on a slow day (load 15-20, issue 46) a run took ~100-150 s to its
    # first GRPO step (warm start, Ray, megatron, vLLM, the first batch) and 3-6 s a step:
    # the allowances are 2-4x that, so what ends on the budget is a run that stopped stepping.
    budget_boot_s: float = Field(480.0, gt=0, description="budget from the start to the "
                                 "first GRPO step")
    budget_step_s: float = Field(15.0, gt=0, description="budget for each GRPO step after "
                                 "the first")
    budget_follows_rate: bool = Field(
        True, description="after 5 steps, raise budget_step_s to 2x the measured median step "
        "when that is more (a slow box is not a failure; a stuck run still is)")
    # Prometheus scrapes every 2 s (services/local/prom.py): the last step's values must be
    # seen by it, even when the final steps take well under a second.
    metrics_linger_s: float = Field(
        5.0, ge=0, le=600, description="the trainer keeps /metrics up this long after its last "
        "step (trainer run.metrics_linger_s); the alerting test holds its final ppo_kl with it")
    prometheus: bool = Field(
        True, description="start a Prometheus with the chart's rules when the binary is on the "
        "PATH; false: none (no alerts evaluated, no dashboard PNGs; a run that checks neither "
        "ends sooner)")
    stop_on_alert: str | None = Field(
        None, description="a chart alert (helm/r3flow/rules): once Prometheus has evaluated it "
        "as firing twice, the run ends as a budget does not: SIGTERM to the trainer (it ends "
        "after its step or its metrics linger, checkpoints, exits 0), then the normal summary "
        "(`stopped_by_alert`). Needs the prometheus binary; the alerting test ends its held "
        "spike with it instead of waiting out metrics_linger_s")


    @field_validator("stop_on_alert")
    @classmethod
    def _chart_alert(cls, v: str | None) -> str | None:
        from services.local.prom import chart_alerts

        if v is not None and v not in chart_alerts():
            raise ValueError(f"{v!r} is not an alert of the chart's rules: "
                             f"{', '.join(chart_alerts())}")
        return v

    @model_validator(mode="after")
    def _alert_needs_prometheus(self) -> LocalConfig:
        if self.stop_on_alert is not None and not self.prometheus:
            raise ValueError(f"stop_on_alert {self.stop_on_alert!r} needs prometheus: true")
        return self

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if families.find(v) is None:
            raise ValueError(f"{v!r} is not one of {', '.join(families.names())}")
        return v


def seeded(cfg: LocalConfig) -> tuple[TaskConfig, TinyMoeConfig]:
    """The task and model configs with the run's `seed` added to their own: one `--seed` moves
    the model init, the data, the warm-start order and the sampling seeds together."""
    return (cfg.task.model_copy(update={"seed": cfg.task.seed + cfg.seed}),
            cfg.model.model_copy(update={"seed": cfg.model.seed + cfg.seed}))


def store_config(cfg: LocalConfig, run_dir: Path) -> dict:
    g = cfg.grpo
    # Backpressure keeps the workers about `backlog_steps` optimizer steps ahead of the trainer
    # instead of generating thousands of groups that would only go stale on 2 cores. The store
    # counts prompt + response tokens, so estimate what a trajectory really holds: with the old
    # "8 + max_tokens" (14) against ~6.5 real tokens ("3+4=" and "7<eos>") the backlog held
    # ~4 steps, past max_policy_lag 3, and 12-15% of the 64-expert runs went stale.
    per_traj = len(f"{cfg.task.max_operand}+{cfg.task.max_operand}=") + min(
        g.max_tokens, len(str(2 * cfg.task.max_operand)) + 1)  # answer + EOS
    backlog = g.backlog_steps * g.groups_per_step * g.group_size * per_traj
    return {"max_policy_lag": g.max_policy_lag, "max_backlog_tokens": backlog,
            "backpressure_retry_ms": 200}


def rollout_concurrency(cfg: LocalConfig) -> int:
    """Requests a worker keeps in its engine (whole groups)."""
    return 4 * cfg.grpo.group_size


def rollout_config(cfg: LocalConfig, run_dir: Path, model_dir: Path, worker: int,
                   plan: FamilyPlan | None = None) -> dict:
    g = cfg.grpo
    dtype = (plan and plan.engine_dtype) or ("bfloat16" if g.dtype == "bf16" else "float32")
    return {
        "engine": {"model": str(model_dir), "max_model_len": cfg.engine.max_model_len,
                   "seed": cfg.seed + worker, "dtype": dtype,
                   "max_num_seqs": cfg.engine.max_num_seqs,
                   "enforce_eager": cfg.engine.enforce_eager,
                   "gpu_memory_utilization": cfg.engine.gpu_memory_utilization,
                   "quantization": cfg.engine.quantization},
        "sampling": {"n": g.group_size, "max_tokens": g.max_tokens, "temperature": g.temperature},
        "dataset": str(run_dir / "data" / "rl.jsonl"),
        "verifier": "services.local.tasks:closeness_reward",
        "concurrency": rollout_concurrency(cfg),
        "worker_id": f"rollout-{worker}",
        "epochs": 1000,
        "num_prompts": cfg.num_prompts,
        "max_policy_lag": g.max_policy_lag,
        # Outlive a store restart or a ~30 s outage: the client backs off up to 5 s per retry.
        "store_max_retries": 30,
    }


# grpo.rollout_correction -> the trainer's loss.rollout_correction
CORRECTIONS: dict[str, dict] = {"off": {}, "tis": {"is_level": "token", "is_threshold": 2.0},
                                "mis": {"mask_level": "token", "mask_low": 0.5, "mask_high": 2.0}}


def backend_config(plan: FamilyPlan | None) -> dict:
    """The trainer config's backend choice and the family's hf knobs (default: megatron)."""
    if plan is None or plan.backend == "megatron":
        return {}
    return {"backend": plan.backend, "hf": dict(plan.hf)}


def trainer_config(cfg: LocalConfig, run_dir: Path, model_dir: Path,
                   plan: FamilyPlan | None = None) -> dict:
    g = cfg.grpo
    backend = backend_config(plan)
    # the hf backend runs one in-process rank (run.launcher local only)
    launcher = "local" if backend else cfg.trainer_launcher
    return {
        **backend,
        "model_dir": str(model_dir),
        "model": {"dtype": g.dtype},
        "optim": {"lr": g.lr, "adam_beta2": g.adam_beta2, "clip_grad": g.clip_grad,
                  "ppo_epochs": g.ppo_epochs, "mini_batches": g.mini_batches},
        "hooks": [h.model_dump() for h in g.hooks],
        "loss": {"kl_coef": g.kl_coef, "entropy_coef": g.entropy_coef, "kl_metric": g.kl_metric,
                 "kl_metric_every": g.measure_every,
                 "adv_std_normalize": g.adv_std_normalize,
                 "rollout_correction": CORRECTIONS[g.rollout_correction]},
        "replay": {"mode": cfg.replay, "compare_off": g.compare_off,
                   "agreement_floor": g.agreement_floor,
                   "compare_off_every": g.measure_every},
        "data": {"groups_per_step": g.groups_per_step, "micro_batch_size": g.micro_batch_size,
                 "lease_seconds": g.lease_seconds, "wait_ms": 2000,
                 "old_logprobs": "trainer" if g.rollout_correction != "off" else g.old_logprobs,
                 "max_policy_lag": g.max_policy_lag},
        "weight_sync": {"timeout_s": g.weight_push_timeout_s},
        "run": {"run_dir": str(run_dir / "trainer"), "steps": g.steps,
                "checkpoint_every": g.checkpoint_every, "async_checkpoint": g.async_checkpoint,
                "push_weights_every": 1, "launcher": launcher,
                "metrics_linger_s": cfg.metrics_linger_s},
        # A private Ray on loopback even when the user's shell has RAY_ADDRESS set.
        "ray": {"address": "local"},
    }


def warm_start_config(cfg: LocalConfig, run_dir: Path, init_dir: Path, out_dir: Path,
                      plan: FamilyPlan | None = None) -> dict:
    return {"model_dir": str(init_dir), "out_dir": str(out_dir), **backend_config(plan),
            "sft_path": str(run_dir / "data" / "sft.jsonl"), "steps": cfg.warm_start_steps,
            "lr": cfg.warm_start_lr, "seed": cfg.seed}
