"""The `eval` section of the rollout config: held-out prompt sets scored on the worker's engine
(services.rollout.evaluation)."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from services.common.config import StrictConfig


class EvalSet(StrictConfig):
    """One held-out prompt set: its results are labelled with `name` (the data source)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="the set's label")
    dataset: str = Field(..., description="JSONL or Parquet file of prompts (dataset format)")


class EvalConfig(StrictConfig):
    """Held-out evaluation on this worker's engine, between its training groups."""

    sets: list[EvalSet] = Field(..., min_length=1, description="the held-out prompt sets")
    every_versions: int = Field(
        1, ge=1, description="score the sets on the weights the worker starts with and after "
        "each weight load whose policy version is a multiple of this (a version that comes "
        "while a score runs is skipped)")
    samples: int = Field(
        4, ge=0, description="n samples per prompt at sampling.temperature for pass@k (besides "
        "the greedy one for accuracy); 0 = greedy only")
    k: list[int] = Field([1], description="pass@k reported for each k (each <= samples)")
    correct_reward: float = Field(
        1.0, description="an answer is correct when its reward is at least this (the built-in "
        "verifiers give 1 for a right answer)")
    max_prompts: int | None = Field(None, ge=1, description="the first N prompts of each set")
    max_tokens: int | None = Field(None, ge=1, description="per turn; None = sampling.max_tokens")
    log: str | None = Field(
        None, description="JSONL file that gets one row per set and score (the trainer's "
        "run.eval_log reads it into its step log)")
    only: bool = Field(
        False, description="score the sets once on the weights at start and exit, no "
        "rollouts (the evaluation job, k8s/eval-job.yaml)")

    on_shard: int | None = Field(
        0, ge=0, description="only the worker of this shard scores (every pod of the chart's "
        "StatefulSet gets the same config; one score per version is enough); None = each "
        "worker")
    linger_s: float = Field(
        0.0, ge=0, le=600, description="with only: keep serving /metrics this long after the "
        "score, so a scraper gets the final gauges (SIGTERM ends it early)")

    def runs_on(self, shard: int) -> bool:
        """Whether the worker of `shard` scores the sets."""
        return self.on_shard is None or self.on_shard == shard

    @model_validator(mode="after")
    def _k_within_samples(self) -> Self:
        bad = [k for k in self.k if not 1 <= k <= self.samples]
        if self.samples and bad:
            raise ValueError(f"k: {bad} outside 1..samples ({self.samples})")
        if not self.samples and self.k != [1]:
            raise ValueError("k: pass@k needs samples > 0")
        if len({s.name for s in self.sets}) != len(self.sets):
            raise ValueError("sets: names must be unique")
        return self
