"""Typed configuration of the rollout worker (`r3flow rollout --config FILE`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from services.common.auth import ClientAuthConfig
from services.common.config import StrictConfig, multiple_of
from services.common.staleness import DEFAULT_MAX_POLICY_LAG, MaxPolicyLag
from services.rollout.eval_config import EvalConfig


class EngineConfig(StrictConfig):
    """How the vLLM AsyncLLM engine is built."""

    model: str = Field(..., description="HF-format model directory")
    max_model_len: int = Field(1024, ge=8, description="prompt + all generated/env tokens")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="engine dtype (vLLM-CPU: float32 or bfloat16)")
    seed: int = Field(0, description="engine seed; request seeds derive from it")
    max_num_seqs: int = Field(32, ge=1, description="engine batch size (sequences per step)")
    block_size: Annotated[int, Field(ge=32), multiple_of(32, "vLLM-CPU attention")] = Field(
        32, description="KV block size (vLLM-CPU: multiple of 32)")
    enable_prefix_caching: bool = Field(True, description="reuse KV of shared prompt prefixes")
    capture_routing: bool = Field(
        True, description="enable_return_routed_experts; off only for baselines (nothing is sent)")
    routing_delivery: Literal["finish", "step"] = Field(
        "finish", description="how vLLM hands a call its routing: finish = once, with the "
        "call's final output (held in the engine core meanwhile, rows up to a cut kept); step "
        "= vLLM's own row per request per decode step (8-15% of decode tokens/s on an H200), "
        "the reference the equality tests compare against")
    policy_version: int = Field(0, ge=0, description="policy version of the weights at `model`")
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one engine spans (vLLM tensor parallel; the chart sets it to "
        "rollout.gpus); must divide the model's attention heads")
    enforce_eager: bool = Field(
        True, description="no CUDA graphs (vLLM-CPU needs it; false on GPUs captures CUDA "
        "graphs: faster decode, longer start and a little more GPU memory)")
    quantization: Literal["none", "fp8"] = Field(
        "none", description="fp8: vLLM's online FP8 (the weights, bf16 from the trainer, "
        "quantized per tensor as they load; every push too): half the engine's weight memory, "
        "faster decode, and routing further from the trainer's (what replay corrects); needs "
        "a CUDA GPU (refused at start on vLLM-CPU)")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=0.98, description="share of each GPU vLLM takes for weights, "
        "activations and KV cache (GPU engines; vLLM-CPU ignores it); leave room for the "
        "weight push's staging ring (3 buckets, trainer.plan counts it)")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="a fixed KV cache size in bytes instead of what is left of "
        "gpu_memory_utilization after vLLM's start-up memory profile (GPU engines): that "
        "profile reads the whole device's free memory, so processes sharing the GPU that "
        "allocate or free meanwhile (the trainer, another engine) shrink the cache or fail "
        "the start; gpu_memory_utilization still has to be free at start")

    @field_validator("tensor_parallel_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two (vLLM shards heads and experts evenly)")
        return v


class SamplingConfig(StrictConfig):
    """Per-request sampling; n samples of one prompt form a GRPO group."""

    n: int = Field(4, ge=1, description="group size (samples per prompt)")
    max_tokens: int = Field(128, ge=1, description="generated tokens per turn")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 for training rollouts: the "
                         "trainer refuses nucleus-truncated segments (truncation not modelled)")
    ignore_eos: bool = Field(False, description="generate max_tokens even past EOS (benchmarks)")
    max_turns: int = Field(1, ge=1, description="agent turns per trajectory (multi-turn envs)")


class PromptConfig(StrictConfig):
    """How dataset rows become prompt tokens: the column mapping, and the chat template."""

    columns: Literal["r3flow", "verl"] = Field(
        "r3flow", description="column preset: r3flow (id, prompt | prompt_token_ids, answer, "
        "verifier; other columns refused) or verl (data_source, prompt, ability, reward_model."
        "ground_truth, extra_info; columns not mapped become the row's extra fields)")
    column_map: dict[str, str] = Field(
        default_factory=dict, description="overrides of the preset: r3flow field (id, prompt, "
        "prompt_token_ids, answer, verifier, data_source) -> source column, dotted for a struct "
        "member (`reward_model.ground_truth`)")
    chat_template: Literal["messages", "always", "never"] = Field(
        "messages", description="messages: a messages-list prompt goes through the tokenizer's "
        "chat template, a text prompt is tokenized as it is (as before); always: a text prompt "
        "becomes one user message first; never: a messages prompt is refused")
    system_prompt: str | None = Field(
        None, description="a system message put first when the prompt has none")
    add_generation_prompt: bool = Field(
        True, description="end the rendered prompt with the assistant turn's header")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra template variables, e.g. "
        "{enable_thinking: false} for Qwen3")


class RewardConfig(StrictConfig):
    """How rewards run: off the generation loop, bounded, with a deadline and a fallback."""

    max_concurrency: int = Field(
        32, ge=1, description="reward calls running at once (sync ones in as many threads)")
    timeout_s: float = Field(
        30.0, gt=0, description="deadline of one reward call; past it the fallback is scored")
    fallback: float = Field(
        0.0, description="reward of a sample whose reward call timed out, raised or returned "
        "no finite number (counted in r3flow_rollout_reward_failures_total by reason)")
    format_pattern: str = Field(
        r"\\boxed\{.+\}", description="regex the `format` verifier searches the response for")

    remote_url: str | None = Field(
        None, description="URL the `remote` verifier POSTs each sample to "
        "(services/rollout/remote_reward.py)")

    @field_validator("format_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v


class RolloutConfig(StrictConfig):
    """Everything `r3flow rollout` needs."""

    engine: EngineConfig
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    dataset: str = Field(..., description="JSONL or Parquet file of prompts")
    prompts: PromptConfig = Field(default_factory=PromptConfig)
    verifier: str = Field(
        "exact_match", description="built-in name (exact_match, numeric, math, format) or "
        "`pkg.mod:fn` (docs/rollout.md#rewards)")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    environment: str | None = Field(
        None, description="multi-turn: `pkg.mod:factory`, factory(dataset row) -> Environment")
    concurrency: int = Field(16, ge=1, description="max requests in the engine at once")
    routing_codec_mode: Literal["canonical", "exact"] = Field(
        "canonical", description="canonical sorts top-k ids (equal routing -> equal bytes)")
    routing_chunk_rows: int = Field(
        4096, ge=1, description="routing rows per encoded chunk: the host copy of a segment's "
        "MoE columns is one chunk at a time, and a long segment goes to the store in parts of "
        "chunks (docs/benchmarks/long-rollouts.md)")
    spill_routing_bytes: int = Field(
        64 << 20, ge=0, description="a group whose finished trajectories hold more encoded "
        "routing than this keeps it in a spill file until the group is sent (0: always; "
        "services/rollout/spill.py)")
    spill_routing_dir: str | None = Field(
        None, description="directory of the routing spill files (default: the system temp dir)")
    partial_rollout_policy: Literal["segment", "replace"] = Field(
        "segment", description="segment: each segment keeps the rows its own engine pass "
        "computed (verl #6046); replace: the last pass's rows everywhere (for comparison); what "
        "each guarantees across a weight update: docs/replay_guarantees.md")
    eval: EvalConfig | None = Field(
        None, description="held-out sets scored on this engine during training "
        "(services.rollout.evaluation); unset = none")
    store: str | None = Field(None, description="store gRPC address; unset = do not send")
    store_auth: ClientAuthConfig = Field(
        default_factory=ClientAuthConfig,  # type: ignore[arg-type]
        description="TLS CA, client cert and the rollout role's token file for the store")
    store_timeout_s: float = Field(30.0, gt=0, description="per-call deadline of store RPCs")
    store_max_retries: int = Field(8, ge=0, description="client retries of one append")
    backpressure_sleep_s: float = Field(
        1.0, gt=0, description="pause before re-sending a group the store refused for capacity")
    metrics_host: str = Field("127.0.0.1", description="bind address of /metrics and /health")
    metrics_port: int = Field(0, ge=0, description="port of /metrics and /health (0 = any free)")
    worker_id: str = Field("rollout-0", min_length=1, description="unique name of this worker")
    num_prompts: int | None = Field(None, ge=1, description="stop after this many groups")
    epochs: int = Field(1, ge=0, description="passes over the dataset; 0 = without end (the "
                        "chart's setting: a pod never exits at the end of the dataset)")
    shuffle: bool = Field(False, description="a new order of the prompts each epoch (seeded by "
                          "data_seed and the epoch: the same order on every worker)")
    data_seed: int = Field(0, description="seed of the epoch shuffles; one value per fleet")
    num_shards: int = Field(1, ge=1, description="workers sharing the dataset: each takes a "
                            "disjoint shard (the chart sets rollout.replicas)")
    shard: int | None = Field(None, ge=0, description="this worker's shard; unset = the trailing "
                              "-N of worker_id (a StatefulSet pod's ordinal), or 0 with one shard")
    max_policy_lag: MaxPolicyLag = Field(
        DEFAULT_MAX_POLICY_LAG, description="hold new groups while the trainer's published "
        "version is ahead of this engine's by more (services.common.staleness; None = never)")
    weight_digests_file: str | None = Field(
        None, description="test/debug aid, off when unset: after each weight push received, "
        "write {version, worker_id, digests: HF name -> tensor_digest of each tensor handed to "
        "the loader} to this JSON file, atomically (compare with the trainer's "
        "weight_sync.export_digests_dir; reads every byte once more)")

    @model_validator(mode="after")
    def _remote_has_url(self) -> Self:
        if self.verifier == "remote" and self.reward.remote_url is None:
            raise ValueError("verifier remote: set reward.remote_url")
        return self

    @model_validator(mode="after")
    def _shard_known(self) -> Self:
        if self.shard_index >= self.num_shards:
            raise ValueError(f"shard {self.shard_index} (worker_id {self.worker_id!r}) must be "
                             f"below num_shards {self.num_shards}")
        return self

    @property
    def shard_index(self) -> int:
        """The shard this worker takes: `shard`, else worker_id's trailing ordinal."""
        if self.shard is not None:
            return self.shard
        if self.num_shards == 1:
            return 0
        m = re.search(r"-(\d+)$", self.worker_id)
        if m is None:
            raise ValueError(f"num_shards {self.num_shards}: set shard, or a worker_id ending "
                             f"in -N (a StatefulSet ordinal), not {self.worker_id!r}")
        return int(m.group(1))
