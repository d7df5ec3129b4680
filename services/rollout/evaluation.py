"""Held-out evaluation on a rollout worker's engine: greedy accuracy and pass@k per prompt set.

The worker scores its `eval` sets (services.rollout.eval_config) on the weights it serves at
start and after every `every_versions`-th weight load, as a background task whose requests share
the engine (and the worker's request limit) with the training groups: the engine batches both,
so training is slowed by the eval's share of the engine, never stopped. A weight load during a
score aborts and resumes its requests like any others (partial rollouts): a row names the
version the score started on and `versions_seen` says if a load came while it ran.

Per set: `accuracy` = share of prompts whose greedy answer is correct (reward >=
`eval.correct_reward`), `pass@k` = the unbiased estimator 1 - C(n-c, k) / C(n, k) from n samples
of which c are correct (Chen et al. 2021), averaged over the prompts. Results go to the
worker's Prometheus gauges, its `eval.log` JSONL and the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.rollout.agent import AgentLoop, RolloutResult
from services.rollout.dataset import PromptRecord, RenderedPrompt, load_dataset
from services.rollout.eval_config import EvalConfig

log = logging.getLogger(__name__)

# the worker's reward of a result (services.rollout.rewards.Reward: .score)
Score = Callable[[RolloutResult, PromptRecord, RenderedPrompt], Awaitable[Any]]
Render = Callable[[PromptRecord], RenderedPrompt]  # the worker's prompt renderer
Limit = Callable[[Awaitable], Awaitable]  # runs one request under the worker's request limit


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def set_scores(greedy: list[bool], correct: list[int], n: int, ks: list[int]) -> dict:
    """One set's figures from each prompt's greedy verdict and correct-sample count."""
    out: dict[str, Any] = {"prompts": len(greedy),
                           "accuracy": sum(greedy) / len(greedy) if greedy else None}
    if n:
        out["pass_at_k"] = {str(k): sum(pass_at_k(n, c, k) for c in correct) / len(correct)
                            for k in ks}
    return out


class Evaluator:
    """Scores the eval sets on an engine; one score at a time."""

    def __init__(self, cfg: EvalConfig, greedy: AgentLoop, sampled: AgentLoop, score: Score,
                 render: Render, limit: Limit, metrics: dict[str, Any]) -> None:
        self.cfg, self.greedy, self.sampled, self.score = cfg, greedy, sampled, score
        self.render, self.limit, self.metrics = render, limit, metrics
        self.sets = {s.name: load_dataset(s.dataset)[:cfg.max_prompts] for s in cfg.sets}
        self.task: asyncio.Task | None = None
        self.rows: list[dict] = []  # every row scored, in order

    def due(self, version: int) -> bool:
        """Whether a load of `version` calls for a score (none running)."""
        running = self.task is not None and not self.task.done()
        return version % self.cfg.every_versions == 0 and not running

    def start(self, version: int, current: Callable[[], int]) -> None:
        """Score in the background."""
        self.task = asyncio.create_task(self.run(version, current))

    async def finish(self, timeout_s: float) -> None:
        """Let a running score end within `timeout_s`, then cancel it."""
        if self.task is None or self.task.done():
            return
        done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        if not done:
            log.warning("eval cut by the stop after %.0fs", timeout_s)
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run(self, version: int, current: Callable[[], int]) -> list[dict]:
        """Score every set on the weights of `version` (`current()`: the version served now);
        the rows, also logged and exported."""
        rows = []
        for name, records in self.sets.items():
            t0 = time.perf_counter()
            verdicts = await asyncio.gather(*[self._prompt(f"eval-v{version}-{name}-{i}", rec)
                                              for i, rec in enumerate(records)])
            row = {"policy_version": version, "source": name,
                   **set_scores([g for g, _ in verdicts], [c for _, c in verdicts],
                                self.cfg.samples, self.cfg.k),
                   "versions_seen": sorted({version, current()}),
                   "seconds": round(time.perf_counter() - t0, 3), "time": time.time()}
            self._publish(row)
            rows.append(row)
        return rows

    async def _prompt(self, rid: str, rec: PromptRecord) -> tuple[bool, int]:
        """(greedy answer correct, correct samples of n) of one prompt."""
        prompt = self.render(rec)
        ids = prompt.token_ids
        runs = [self.limit(self.greedy.run(f"{rid}-g", ids, seed=0))]
        runs += [self.limit(self.sampled.run(f"{rid}-s{j}", ids, seed=j))
                 for j in range(self.cfg.samples)]
        results = await asyncio.gather(*runs)
        rewards = await asyncio.gather(*[self.score(r, rec, prompt) for r in results])
        ok = [r.score >= self.cfg.correct_reward for r in rewards]
        return ok[0], sum(ok[1:])

    def _publish(self, row: dict) -> None:
        self.rows.append(row)
        src = row["source"]
        log.info("eval v%d %s: accuracy %s over %d prompts, pass@k %s (%.1fs)",
                 row["policy_version"], src, row["accuracy"], row["prompts"],
                 row.get("pass_at_k", {}), row["seconds"])
        if row["accuracy"] is not None:
            self.metrics["r3flow_rollout_eval_accuracy"].labels(src).set(row["accuracy"])
        for k, v in row.get("pass_at_k", {}).items():
            self.metrics["r3flow_rollout_eval_pass_at_k"].labels(src, k).set(v)
        self.metrics["r3flow_rollout_eval_policy_version"].labels(src).set(row["policy_version"])
        if self.cfg.log:
            path = Path(self.cfg.log)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
