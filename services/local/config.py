"""`r3flow local` configuration, and the component configs it renders for its children.

A run config holds the same `store:` / `rollout:` / `trainer:` sections as the chart's values
(`store.config`, `rollout.config`, `trainer.config`) and the k8s job specs: each is the
component's own config (StoreConfig, RolloutConfig, TrainerConfig), laid over PRESET (what
`r3flow local` runs when a section leaves a knob unset), so every knob works in both. The
children get exactly the config files a Kubernetes deployment would mount, written into the run
folder, so the local run exercises the same `r3flow store|rollout|train` commands.

The run decides what a deployment's chart decides: paths, worker ids, per-worker seeds, the
trainer's `data.max_policy_lag` (the store's, as the chart sets it) and, where a section leaves
them unset, the store's backlog budget, the engines' dtype and concurrency.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError, field_validator, model_validator

from services.common import families
from services.common.config import StrictConfig, deep_merge, describe
from services.common.tiny_moe import TinyMoeConfig
from services.local.tasks import TaskConfig
from services.rollout.config import RolloutConfig
from services.store.config import StoreConfig
from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from services.local.family import FamilyPlan

# What `r3flow local` runs where its sections leave a knob unset (over the components' own
# defaults): a 2-core box, a tiny MoE, a task GRPO measurably improves in a few minutes.
PRESET: dict[str, dict[str, Any]] = {
    "store": {
        # Fully asynchronous with bounded staleness: rollouts run up to 3 versions ahead of the
        # trainer and the PPO ratio is taken against the rollout's own logprobs (the behaviour
        # policy), so ppo_kl and the clip fraction measure real off-policyness. Measured on the
        # 2-core box (8-expert model): lag 3 dropped 5.3% of produced trajectories as stale
        # (lag 2: 13.8%, lag 0: 37%) and the reward rose 0.48 -> 0.82 (BENCHMARKS.md, "Local
        # run"); with the 64-expert model and the backlog budget of store_config, lag 3 dropped
        # none (seed 1). The rollout workers and the trainer take it from here.
        "max_policy_lag": 3,
        "backpressure_retry_ms": 200,
    },
    "rollout": {
        "engine": {"max_model_len": 64, "max_num_seqs": 32, "enforce_eager": True,
                   "gpu_memory_utilization": 0.85},
        "sampling": {"n": 8, "max_tokens": 6, "temperature": 1.0},
        "verifier": "services.local.tasks:closeness_reward",
        "epochs": 1000,
        # Outlive a store restart or a ~30 s outage: the client backs off up to 5 s per retry.
        "store_max_retries": 30,
    },
    "trainer": {
        "model": {"dtype": "bf16"},
        # 3e-4 for the 64-expert local model: at 1e-3 its ppo_kl was 0.04-0.26 a step and the
        # clip fraction 0.13-0.24 (the 8-expert model's 1e-3 gave a median of 8e-3); at 3e-4
        # ppo_kl is within +-8e-3 and the reward still rises (BENCHMARKS.md "make run: r3 vs
        # off").
        "optim": {"lr": 3e-4},
        # The no-replay comparison and the reference pass were two of a step's four passes over
        # the batch (issue 46): measured on step 1 (the engine/trainer mismatch alone) and every
        # 4th step after it, they still draw both curves and the report's ratios, which pair
        # only the steps that measured both.
        "loss": {"kl_metric": True, "kl_metric_every": 4},
        "replay": {"compare_off": True, "compare_off_every": 4},
        # 32 groups: the per-step reward is a mean over 32 prompts, so the first-5/last-5
        # comparison is not at the mercy of which prompts a step drew (16 groups: last-5 means
        # swung by ~0.1). Micro-batch 256: a step's short rows in one forward instead of 16 (the
        # same update: the loss is normalised over the whole step).
        "data": {"groups_per_step": 32, "micro_batch_size": 256, "old_logprobs": "rollout"},
        # 40 steps (was 80): `make run` under 10 minutes on a slow 2-core day (issue 46;
        # docs/benchmarks/local-run.md "make run on a slow box"). Prometheus scrapes every 2 s
        # (services/local/prom.py): the last step's values must be seen by it (metrics_linger_s).
        "run": {"steps": 40, "checkpoint_every": 1, "launcher": "ray", "metrics_linger_s": 5.0},
        # A private Ray on loopback even when the user's shell has RAY_ADDRESS set.
        "ray": {"address": "local"},
    },
}
SECTIONS: dict[str, type[StrictConfig]] = {
    "store": StoreConfig, "rollout": RolloutConfig, "trainer": TrainerConfig}
# Where the keys of the old flat config went (a config that still uses one is refused, naming it).
RENAMED: dict[str, str] = {
    **{f"grpo.{k}": f"trainer.{v}" for k, v in {
        "steps": "run.steps", "groups_per_step": "data.groups_per_step", "lr": "optim.lr",
        "adam_beta2": "optim.adam_beta2", "clip_grad": "optim.clip_grad",
        "ppo_epochs": "optim.ppo_epochs", "mini_batches": "optim.mini_batches",
        "kl_coef": "loss.kl_coef", "kl_metric": "loss.kl_metric",
        "rollout_correction": "loss.rollout_correction (with trainer.data.old_logprobs: trainer)",
        "entropy_coef": "loss.entropy_coef", "adv_std_normalize": "loss.adv_std_normalize",
        "old_logprobs": "data.old_logprobs", "lease_seconds": "data.lease_seconds",
        "weight_push_timeout_s": "weight_sync.timeout_s",
        "dtype": "model.dtype (rollout.engine.dtype follows it)",
        "compare_off": "replay.compare_off", "agreement_floor": "replay.agreement_floor",
        "measure_every": "replay.compare_off_every and trainer.loss.kl_metric_every",
        "micro_batch_size": "data.micro_batch_size", "checkpoint_every": "run.checkpoint_every",
        "hooks": "hooks"}.items()},
    **{f"grpo.{k}": f"rollout.sampling.{v}" for k, v in {
        "group_size": "n", "max_tokens": "max_tokens", "temperature": "temperature"}.items()},
    **{f"engine.{k}": f"rollout.engine.{k}" for k in (
        "enforce_eager", "gpu_memory_utilization", "max_num_seqs", "max_model_len")},
    "grpo.max_policy_lag": "store.max_policy_lag (the rollout workers and trainer follow it)",
    "grpo.backlog_steps": "backlog_steps",
    "replay": "trainer.replay.mode", "trainer_backend": "trainer.backend",
    "trainer_launcher": "trainer.run.launcher", "num_prompts": "rollout.num_prompts",
    "metrics_linger_s": "trainer.run.metrics_linger_s",
}
# Stand-ins for the run's paths when a config is checked before a run folder exists.
CHECK_DIR = Path("<run>")


def local_model() -> TinyMoeConfig:
    """The MoE `r3flow local` trains: 64 experts, top-8, 4 MoE layers.

    TinyMoeConfig's own defaults (8 experts, top-2, 2 layers; what most tests build, for speed)
    have router margins so wide that hardly a routing decision differs between vLLM and the
    trainer: replay changed |Δlogprob| by 13% (ratio 0.87). With 64 experts top-8 over 4 layers
    the same batch at the same weights gives 1.84e-3 with replay against 2.79e-3 without (0.66,
    seed 0; BENCHMARKS.md "make run: r3 vs off")."""
    return TinyMoeConfig(num_experts=64, top_k=8, num_layers=4)


class LocalConfig(StrictConfig):
    """Everything `r3flow local` decides: its own knobs, and the components' sections."""

    runs_dir: str = Field("runs", description="parent of the per-run folders")
    family: str = Field(families.DEFAULT, description="MoE family of the tiny model (HF "
                        "model_type, one of services.common.families); it also decides the trainer "
                        "backend when trainer.backend is unset (services.local.family)")
    workers: int = Field(1, ge=1, le=4, description="rollout worker processes")
    seed: int = Field(0, description="added to the model's, the task's and each engine's seed")
    model: TinyMoeConfig = Field(
        default_factory=local_model, description="sizes of the MoE built for the run ({} = "
        "TinyMoeConfig's small defaults, as the tests use)")
    # Single-digit operands (100 problems) and a short warm start: GRPO starts at a mid-range
    # reward (~0.5) on a task it can measurably improve within 80 steps. Operands up to 19 with
    # 60 warm-start steps started at ~0.5 too but learnt slowly (gains 0.06-0.21 over 80 steps).
    task: TaskConfig = Field(default_factory=lambda: TaskConfig(max_operand=9))
    warm_start_steps: int = Field(12, ge=0, description="supervised steps before GRPO")
    warm_start_lr: float = Field(3e-3, gt=0)
    backlog_steps: int = Field(
        2, ge=2, description="the store's backlog budget in optimizer steps, where "
        "store.max_backlog_tokens is unset (store_config)")
    store: dict[str, Any] = Field(
        default_factory=dict, description="the store's config (services/store/config.py "
        "StoreConfig, the chart's store.config) over PRESET['store']")
    rollout: dict[str, Any] = Field(
        default_factory=dict, description="each rollout worker's config (services/rollout/"
        "config.py RolloutConfig, the chart's rollout.config) over PRESET['rollout']")
    trainer: dict[str, Any] = Field(
        default_factory=dict, description="the trainer's config (trainer/config.py "
        "TrainerConfig, the chart's trainer.config) over PRESET['trainer']; backend unset: "
        "the family decides")
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
    prometheus: bool = Field(
        True, description="start a Prometheus with the chart's rules when the binary is on the "
        "PATH; false: none (no alerts evaluated, no dashboard PNGs; a run that checks neither "
        "ends sooner)")
    stop_on_alert: str | None = Field(
        None, description="a chart alert (helm/r3flow/rules): once Prometheus has evaluated it "
        "as firing twice, the run ends as a budget does not: SIGTERM to the trainer (it ends "
        "after its step or its metrics linger, checkpoints, exits 0), then the normal summary "
        "(`stopped_by_alert`). Needs the prometheus binary; the alerting test ends its held "
        "spike with it instead of waiting out trainer.run.metrics_linger_s")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in data if k in RENAMED] + [
                f"{k}.{sub}" for k in ("grpo", "engine") if isinstance(data.get(k), dict)
                for sub in data[k] if f"{k}.{sub}" in RENAMED]
            if old:
                raise ValueError("; ".join(f"{k} is {RENAMED[k]} now" for k in old) +
                                 " (r3flow local takes the chart's store/rollout/trainer sections)")
        return data

    @model_validator(mode="after")
    def _sections_valid(self) -> LocalConfig:
        for name in SECTIONS:
            checked(name, section(self, name))
        store, rollout, trainer = (resolved(self, name) for name in SECTIONS)
        lag = self.trainer.get("data", {}).get("max_policy_lag", store.max_policy_lag)
        if lag != store.max_policy_lag:
            raise ValueError(f"trainer.data.max_policy_lag={lag} but store.max_policy_lag="
                             f"{store.max_policy_lag}: leave it unset (the run sets the "
                             "trainer's from the store's, as the chart does)")
        if trainer.run.steps < 1:
            raise ValueError("trainer.run.steps: r3flow local runs a fixed number of steps (>= 1)")
        if rollout.sampling.n < 2:
            raise ValueError("rollout.sampling.n: a GRPO group needs at least 2 samples")
        return self

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

    @property
    def trainer_backend(self) -> str | None:
        """The trainer backend the config names (None: the family decides)."""
        return self.trainer.get("backend")


def section(cfg: LocalConfig, name: str) -> dict[str, Any]:
    """Section `name` over its preset, with stand-ins for a rollout worker's required paths."""
    stand_ins = {"rollout": {"engine": {"model": str(CHECK_DIR)}, "dataset": str(CHECK_DIR)}}
    return deep_merge(stand_ins.get(name, {}), PRESET[name], getattr(cfg, name))


def checked(name: str, data: dict[str, Any]) -> Any:
    """`data` as section `name`'s config; ValueError naming every bad key as `name.key`."""
    try:
        return SECTIONS[name].model_validate(data)
    except ValidationError as e:
        raise ValueError(describe(e, section=name)) from None


def resolved(cfg: LocalConfig, name: str) -> Any:
    """The config `cfg` gives component `name` (StoreConfig, RolloutConfig of worker 0, or
    TrainerConfig), with stand-ins for the run's paths and the default family plan."""
    render = {"store": lambda: store_config(cfg, CHECK_DIR),
              "rollout": lambda: rollout_config(cfg, CHECK_DIR, CHECK_DIR, 0),
              "trainer": lambda: trainer_config(cfg, CHECK_DIR, CHECK_DIR)}[name]
    return checked(name, render())


def seeded(cfg: LocalConfig) -> tuple[TaskConfig, TinyMoeConfig]:
    """The task and model configs with the run's `seed` added to their own: one `--seed` moves
    the model init, the data, the warm-start order and the sampling seeds together."""
    return (cfg.task.model_copy(update={"seed": cfg.task.seed + cfg.seed}),
            cfg.model.model_copy(update={"seed": cfg.model.seed + cfg.seed}))


def backlog_tokens(cfg: LocalConfig) -> int:
    """The store's backlog budget: `backlog_steps` optimizer steps of trajectories."""
    sampling = checked("rollout", section(cfg, "rollout")).sampling
    groups = checked("trainer", section(cfg, "trainer")).data.groups_per_step
    # Backpressure keeps the workers about `backlog_steps` optimizer steps ahead of the trainer
    # instead of generating thousands of groups that would only go stale on 2 cores. The store
    # counts prompt + response tokens, so estimate what a trajectory really holds: with the old
    # "8 + max_tokens" (14) against ~6.5 real tokens ("3+4=" and "7<eos>") the backlog held
    # ~4 steps, past max_policy_lag 3, and 12-15% of the 64-expert runs went stale.
    per_traj = len(f"{cfg.task.max_operand}+{cfg.task.max_operand}=") + min(
        sampling.max_tokens, len(str(2 * cfg.task.max_operand)) + 1)  # answer + EOS
    return cfg.backlog_steps * groups * sampling.n * per_traj


def store_config(cfg: LocalConfig, run_dir: Path) -> dict:
    """The store's config file: the store section over the preset and the backlog budget."""
    return deep_merge(PRESET["store"], {"max_backlog_tokens": backlog_tokens(cfg)}, cfg.store)


def rollout_concurrency(cfg: LocalConfig) -> int:
    """Requests a worker keeps in its engine (whole groups)."""
    return resolved(cfg, "rollout").concurrency


def rollout_config(cfg: LocalConfig, run_dir: Path, model_dir: Path, worker: int,
                   plan: FamilyPlan | None = None) -> dict:
    """Worker `worker`'s config file: the rollout section over the preset and what the run
    derives (the engine dtype from the trainer's, 4 groups in flight, the store's lag)."""
    rollout = checked("rollout", section(cfg, "rollout"))
    dtype = checked("trainer", section(cfg, "trainer")).model.dtype
    derived = {"engine": {"dtype": "bfloat16" if dtype == "bf16" else "float32"},
               "concurrency": 4 * rollout.sampling.n,
               "max_policy_lag": checked("store", section(cfg, "store")).max_policy_lag}
    run = {"engine": {"model": str(model_dir), "seed": cfg.seed + worker,
                      **({"dtype": plan.engine_dtype} if plan and plan.engine_dtype else {})},
           "dataset": str(run_dir / "data" / "rl.jsonl"), "worker_id": f"rollout-{worker}"}
    return deep_merge(PRESET["rollout"], derived, cfg.rollout, run)


# The --compare arms' rollout corrections -> the trainer's loss.rollout_correction
CORRECTIONS: dict[str, dict] = {"off": {"is_level": "off", "mask_level": "off"},
                                "tis": {"is_level": "token", "is_threshold": 2.0},
                                "mis": {"mask_level": "token", "mask_low": 0.5, "mask_high": 2.0}}


def backend_config(plan: FamilyPlan | None) -> dict:
    """The trainer config's backend choice and the family's hf knobs (default: megatron)."""
    if plan is None or plan.backend == "megatron":
        return {}
    return {"backend": plan.backend, "hf": dict(plan.hf)}


def trainer_config(cfg: LocalConfig, run_dir: Path, model_dir: Path,
                   plan: FamilyPlan | None = None) -> dict:
    """The trainer's config file: the trainer section over the preset, the family's backend,
    the run's paths and the store's max_policy_lag."""
    backend = backend_config(plan)
    lag = checked("store", section(cfg, "store")).max_policy_lag
    run = {**backend, "model_dir": str(model_dir), "data": {"max_policy_lag": lag},
           # the hf backend runs one in-process rank (run.launcher local only)
           "run": {"run_dir": str(run_dir / "trainer"), **({"launcher": "local"} if backend
                                                             else {})}}
    return deep_merge(PRESET["trainer"], cfg.trainer, run)


def warm_start_config(cfg: LocalConfig, run_dir: Path, init_dir: Path, out_dir: Path,
                      plan: FamilyPlan | None = None) -> dict:
    return {"model_dir": str(init_dir), "out_dir": str(out_dir), **backend_config(plan),
            "sft_path": str(run_dir / "data" / "sft.jsonl"), "steps": cfg.warm_start_steps,
            "lr": cfg.warm_start_lr, "seed": cfg.seed}
