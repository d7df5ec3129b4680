"""Verifiable toy tasks for the local run: data sets and their reward functions.

`addition`: "37+45=" -> "82". The RL prompts are messages (one user turn) that the rollout
renders with the tiny model's chat template, to the same tokens as the warm start's text
prompts. The reward grades a wrong number by how far off it is, so a tiny model's progress
shows up as a smooth signal; an answer the math verifier accepts scores 1.0.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from pydantic import Field

from services.common.config import StrictConfig
from services.rollout.math_grader import math_reward


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
            messages = [{"role": "user", "content": ex["prompt"]}]
            f.write(json.dumps({"id": f"add-{i}", "prompt": messages,
                                "answer": ex["answer"]}) + "\n")
    with sft_path.open("w") as f:
        for _ in range(cfg.num_sft_examples):
            f.write(json.dumps(addition_example(sft_rng, cfg.max_operand)) + "\n")
    return rl_path, sft_path


def closeness_reward(completion: str, answer: str) -> float:
    """A bare number: 1.0 when the `math` verifier accepts it, else 0.8 * exp(-d / 4) for a
    number off by d; anything else 0.

    Graded by numeric distance so that two wrong answers are not equally wrong: a group whose
    samples are all wrong still ranks them, which gives GRPO a signal from the first step.
    """
    text = completion.strip()
    if not text.isdigit():
        return 0.0
    if math_reward(text, answer) == 1.0:
        return 1.0
    return 0.8 * math.exp(-abs(int(text) - int(answer)) / 4.0)
