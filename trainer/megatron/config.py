"""`ModelConfig`: how the trainer builds its megatron-core model (the config of
trainer.megatron.model, kept apart so a config loads no runtime module); `SECTIONS` registers it
as TrainerConfig's `model` section (trainer.registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from services.common import families
from services.common.config import StrictConfig

if TYPE_CHECKING:  # trainer.config loads this module by name while it builds TrainerConfig
    from trainer.config import ModelSection, TrainerConfig


def grouped_experts_run(family: str | None) -> bool:
    """False for a family whose routed experts the grouped module cannot run
    (trainer.megatron.grouped_experts: expert biases; services.common.families:
    megatron_grouped_experts): `experts: auto` keeps them sequential."""
    fam = families.find(family)
    return fam is None or fam.megatron_grouped_experts


class ModelConfig(StrictConfig):
    """How the trainer builds its megatron-core model."""

    dtype: Literal["fp32", "bf16"] = Field("fp32", description="parameter/compute dtype")
    dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="megatron MoE token dispatcher")
    tensor_parallel: int = Field(1, ge=1, description="tensor-parallel size (attention heads, "
                                 "dense MLP, vocabulary split; needs sequence_parallel)")
    sequence_parallel: bool = Field(False, description="shard the sequence over the tensor-"
                                    "parallel ranks outside attention/MLP (required with TP > 1: "
                                    "each TP rank routes only its sequence slice)")
    pipeline_parallel: int = Field(1, ge=1, description="pipeline stages (1F1B schedule); each "
                                   "stage builds and replays only its own layers")
    context_parallel: int = Field(1, ge=1, description="context-parallel size (needs "
                                  "TransformerEngine attention: only 1 with the local spec)")
    expert_parallel: int = Field(1, ge=1, description="expert-parallel size (ranks per expert set)")
    expert_tensor_parallel: int = Field(1, ge=1, description="tensor-parallel size inside each "
                                        "expert (expert FFN width split)")
    recompute_granularity: Literal["none", "full", "selective"] = Field(
        "none", description="activation recompute: full (whole layers, recompute_method / "
        "recompute_num_layers), selective (recompute_modules)")
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform", description="full recompute: uniform (every layer, in units of "
        "recompute_num_layers) or block (the first recompute_num_layers layers of each stage)")
    recompute_num_layers: int = Field(1, ge=1, description="full recompute: layers per unit "
                                      "(uniform) or recomputed layers per stage (block)")
    recompute_modules: list[str] = Field(
        default_factory=lambda: ["moe"], description="selective recompute: megatron "
        "recompute_modules (moe, core_attn, mlp, layernorm, ...)")
    recompute_moe: bool = Field(False, description="shorthand for recompute_granularity "
                                "selective with recompute_modules [moe] (kept for old configs)")
    router_dtype: Literal["auto", "fp32", "native"] = Field(
        "auto", description="dtype of the router logits: fp32 (upcast), native (the model "
        "dtype), auto = what the rollout engine does for this model family (its "
        "engine_router_dtype in services/common/families/; Qwen3-MoE: native), resolved when the model is built and logged")
    seed: int = Field(1234, description="megatron RNG seed (init of unused params, dropout)")
    aux_loss_coeff: float = Field(
        0.0, ge=0, description="megatron's load-balancing loss (moe_router_load_balancing_type "
        "aux_loss, moe_aux_loss_coeff) at this coefficient; 0 = none (GRPO steps). The warm "
        "start sets it from the model's router_aux_loss_coef (services/local/warm_start.py)")
    experts: Literal["auto", "sequential", "grouped"] = Field(
        "auto", description="routed experts: sequential (megatron's SequentialMLP, a loop "
        "of linears per expert; the reference) or grouped (trainer.megatron.grouped_experts: "
        "stacked weights, one torch._grouped_mm per projection on CUDA bf16); auto = grouped "
        "on CUDA with dtype bf16 where it applies (expert_tensor_parallel 1, no expert biases: "
        "not gpt_oss), else sequential (fast_path(); logged at start)")
    attention: Literal["auto", "unfused", "sdpa"] = Field(
        "auto", description="core attention: unfused (megatron's DotProductAttention; the "
        "reference) or sdpa (trainer.megatron.fused_attention: fused causal "
        "F.scaled_dot_product_attention, GQA without K/V repeat; families with sinks, sliding "
        "windows or MLA keep DotProductAttention); auto = sdpa on CUDA with dtype bf16 and "
        "context_parallel 1, else unfused")
    planned_dispatch: bool | Literal["auto"] = Field(
        "auto", description="replay-aware MoE dispatch (trainer.megatron.planned_dispatch): "
        "under r3/r2 the all-to-all split sizes of every MoE layer of a pass are computed from "
        "the replayed ids before it (one gather and one host copy per pass instead of a host "
        "sync per layer); needs dispatcher alltoall; auto = on on CUDA with dtype bf16 and "
        "dispatcher alltoall, else off")
    batch_first_logits: bool | Literal["auto"] = Field(
        "auto", description="the output layer makes the logits in [B, S, V] order "
        "(trainer.megatron.batch_first_logits): no copy of the logits, nor of their gradient, "
        "for megatron's [S, B, V] -> [B, S, V] transpose; needs sequence_parallel off; auto = "
        "on on CUDA with dtype bf16 and sequence_parallel off, else off (issue 55: r3 step "
        "0.152 -> 0.143 s on one H200, docs/benchmarks/megatron-parallel.md)")
    moe_permute: Literal["auto", "megatron", "gather"] = Field(
        "megatron", description="how MoE tokens are put in expert order and back "
        "(trainer.megatron.gather_permute): megatron = moe_utils.permute / unpermute (argsort, "
        "bf16 scatter_add / index_add atomics); gather = gathers with fp32 sums over the "
        "top-k (deterministic, no atomics), and no local-expert sort where the tp x ep group is "
        "one rank; needs planned_dispatch on; auto = gather where planned_dispatch is on. "
        "megatron by default until the bench has measured gather on a GPU (issue 55)")

    @model_validator(mode="after")
    def _recompute_once(self) -> ModelConfig:
        if self.recompute_moe and self.recompute_granularity != "none":
            raise ValueError("model.recompute_moe: set either it or recompute_granularity")
        if self.planned_dispatch is True and self.dispatcher != "alltoall":
            raise ValueError(f"model.planned_dispatch: needs dispatcher alltoall, not "
                             f"{self.dispatcher}")
        if self.moe_permute == "gather" and self.planned_dispatch is False:
            raise ValueError("model.moe_permute: gather needs model.planned_dispatch on (its "
                             "dispatcher is the planned one's subclass)")
        if self.batch_first_logits is True and self.sequence_parallel:
            raise ValueError("model.batch_first_logits: needs sequence_parallel off (the output "
                             "layer's input is split on the sequence dimension)")
        return self

    def fast_path(self, cuda: bool, family: str | None = None) -> ModelConfig:
        """`self` with every `auto` fast-path switch decided (idempotent): the fast path
        (grouped experts, SDPA, planned dispatch; batch-first logits when set to auto) on a
        CUDA device with dtype bf16 where each applies, the reference path (sequential, unfused,
        no plan, logits through megatron's copy) on CPU or in fp32. `family` (HF model_type) leaves out what a
        family cannot run (gpt_oss: expert biases)."""
        fast = cuda and self.dtype == "bf16"
        update: dict[str, Any] = {}
        if self.experts == "auto":
            grouped = fast and self.expert_tensor_parallel == 1 and grouped_experts_run(family)
            update["experts"] = "grouped" if grouped else "sequential"
        if self.attention == "auto":
            update["attention"] = "sdpa" if fast and self.context_parallel == 1 else "unfused"
        if self.planned_dispatch == "auto":
            update["planned_dispatch"] = fast and self.dispatcher == "alltoall"
        if self.batch_first_logits == "auto":
            update["batch_first_logits"] = fast and not self.sequence_parallel
        if self.moe_permute == "auto":
            planned = update.get("planned_dispatch", self.planned_dispatch)
            update["moe_permute"] = "gather" if planned is True else "megatron"
        return self.model_copy(update=update) if update else self

    @property
    def is_fast_path(self) -> bool:
        """Every fast-path switch of the model on (after fast_path())."""
        return (self.experts, self.attention, self.planned_dispatch) == ("grouped", "sdpa", True)

    @property
    def recompute(self) -> str:
        """The recompute that runs: none | full | selective(<modules>)."""
        if self.recompute_moe:
            return "selective(moe)"
        if self.recompute_granularity == "selective":
            return f"selective({','.join(self.recompute_modules)})"
        return self.recompute_granularity

    @property
    def recompute_set(self) -> bool:
        """The config sets recompute (recompute_moe or recompute_granularity given, even to
        its default): `r3flow plan` plans it as set; unset, the trainer recomputes nothing and
        the plan names the lightest recompute that fits (trainer.plan.memory.choose_recompute)."""
        return bool({"recompute_moe", "recompute_granularity"} & self.model_fields_set)

    @property
    def recomputes_router(self) -> bool:
        """Backward re-runs the router: replay pops each micro-batch's ids (REPLAY_BACKWARD)."""
        return self.recompute == "full" or "moe" in self.recompute.removeprefix(
            "selective(").rstrip(")").split(",")

    def recompute_kwargs(self) -> dict[str, Any]:
        """TransformerConfig's recompute options."""
        if self.recompute == "full":
            return {"recompute_granularity": "full", "recompute_method": self.recompute_method,
                    "recompute_num_layers": self.recompute_num_layers}
        if self.recompute.startswith("selective"):
            return {"recompute_granularity": "selective", "recompute_modules":
                    ["moe"] if self.recompute_moe else list(self.recompute_modules)}
        return {}


# The megatron backend's registration (trainer.registry): the TrainerConfig section it adds and
# its checks of a whole config.
SECTIONS: dict[str, type[StrictConfig]] = {"model": ModelConfig}


if TYPE_CHECKING:  # mypy: ModelConfig gives the neutral core what it reads of the section
    _NEUTRAL_VIEW: type[ModelSection] = ModelConfig


def model_section(cfg: TrainerConfig) -> ModelConfig:
    """`cfg.model`, typed: TrainerConfig holds the section as Any (its schema is registered
    here, trainer.registry), so the backends read it through this."""
    if not isinstance(cfg.model, ModelConfig):
        raise TypeError(f"model: expected a ModelConfig section, got {type(cfg.model).__name__}")
    return cfg.model


def check_trainer(cfg: TrainerConfig) -> None:
    """A TrainerConfig with backend megatron: the ray launcher's layout fits run.world_size."""
    if cfg.run.launcher == "ray":
        from trainer.megatron.parallel import check_layout  # torch: only when there is a layout

        check_layout(model_section(cfg), cfg.run.world_size, pad_multiple=cfg.data.pad_multiple)
