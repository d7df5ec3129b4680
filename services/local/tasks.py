"""Verifiable toy tasks for the local run: data sets and their reward functions.

`addition`: "37+45=" -> "82". Rewards give partial credit per answer digit so a tiny model's
progress shows up as a smooth signal; an exact answer scores 1.0.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import Field

from services.common.config import StrictConfig


class TaskConfig(StrictConfig):
    """Which toy task, how many prompts, and the seed that makes the data reproducible."""

    name: str = Field("addition", pattern="^(addition)$", description="toy task")
    num_prompts: int = Field(512, ge=1, description="prompts in the RL data set")
    num_sft_examples: int = Field(4096, ge=1, description="examples for the warm start")
    max_operand: int = Field(99, ge=1, le=9999, description="largest operand")
    seed: int = 0


def addition_example(rng: random.Random, max_operand: int) -> dict[str, str]:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def write_datasets(cfg: TaskConfig, out_dir: Path) -> tuple[Path, Path]:
    """Write `rl.jsonl` (prompts for rollouts) and `sft.jsonl` (prompt+answer pairs); disjoint seeds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rl_path, sft_path = out_dir / "rl.jsonl", out_dir / "sft.jsonl"
    rl_rng, sft_rng = random.Random(cfg.seed), random.Random(cfg.seed + 1_000_003)
    with rl_path.open("w") as f:
        for i in range(cfg.num_prompts):
            ex = addition_example(rl_rng, cfg.max_operand)
            f.write(json.dumps({"id": f"add-{i}", **ex}) + "\n")
    with sft_path.open("w") as f:
        for _ in range(cfg.num_sft_examples):
            f.write(json.dumps(addition_example(sft_rng, cfg.max_operand)) + "\n")
    return rl_path, sft_path


def digit_reward(completion: str, answer: str) -> float:
    """1.0 for the exact answer; otherwise 0.5 x the fraction of answer digits right in place."""
    text = completion.strip()
    if text == answer:
        return 1.0
    if not text:
        return 0.0
    hits = sum(1 for x, y in zip(text, answer, strict=False) if x == y)
    length_penalty = min(len(text), len(answer)) / max(len(text), len(answer))
    return 0.5 * hits / len(answer) * length_penalty
