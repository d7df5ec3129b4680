"""Runs reward calls off the generation loop: at most `max_concurrency` at once, each under a
deadline; sync verifiers in a bounded thread pool, async ones on the loop. A call that times
out, raises, or returns no finite score gets the configured fallback, is counted by reason in
`r3flow_rollout_reward_failures_total` and logged (repeats counted); it never fails its group
or stops the worker.

A timed-out sync call cannot be interrupted: its thread runs on holding its slot, and later
calls wait for a slot within their own deadline, so a judge that hangs costs reward
throughput (fallback scores), never generation.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.rollout.config import RewardConfig
from services.rollout.remote_reward import RemoteReward
from services.rollout.report import RepeatedLog
from services.rollout.verifiers import RewardFn, RewardInput, VerifierRegistry

FAILURE_REASONS = ("timeout", "error", "invalid")


@dataclass
class Reward:
    """A scored sample: the reward, extra scalars (reward components), and why the fallback
    was used (None when the verifier answered)."""

    score: float
    components: dict[str, float] = field(default_factory=dict)
    failure: str | None = None


def to_reward(raw: Any) -> Reward:
    """A verifier's float or dict (`score` + scalars) as a Reward; ValueError otherwise."""
    if isinstance(raw, Mapping):
        if "score" not in raw:
            raise ValueError(f"a dict reward needs a `score` key, got keys {sorted(raw)}")
        extra = {str(k): float(v) for k, v in raw.items() if k != "score" and _is_number(v)}
        score = raw["score"]
    else:
        score, extra = raw, {}
    if not _is_number(score):
        raise ValueError(f"expected a number, got {type(score).__name__}")
    if not math.isfinite(score) or not all(math.isfinite(v) for v in extra.values()):
        raise ValueError(f"not finite: {score!r} {extra}")
    return Reward(float(score), extra)


def build_registry(cfg: RewardConfig) -> VerifierRegistry:
    """The worker's verifiers: the built-ins, `format` with its pattern, and `remote` when
    `remote_url` is set."""
    bound = {}
    if cfg.remote_url is not None:
        bound["remote"] = RewardFn("remote", RemoteReward(cfg.remote_url), is_async=True)
    return VerifierRegistry(cfg.format_pattern, bound)


def _is_number(v: Any) -> bool:
    """A real number (numpy scalars included), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class RewardRunner:
    """Scores samples with bounded concurrency and a per-call deadline (one per worker)."""

    def __init__(self, cfg: RewardConfig, metrics: Mapping[str, Any], errors: RepeatedLog
                 ) -> None:
        self.cfg = cfg
        self._failures = metrics["r3flow_rollout_reward_failures_total"]
        self._errors = errors
        self._slots = asyncio.Semaphore(cfg.max_concurrency)

    async def score(self, fn: RewardFn, sample: RewardInput) -> Reward:
        """The reward of `sample`, or the fallback (with its reason) on any failure. The
        deadline covers the wait for a slot too: slots held by hung calls cannot stall it."""
        try:
            raw = await asyncio.wait_for(self._run(fn, sample), self.cfg.timeout_s)
        except TimeoutError:
            return self._fallback("timeout", fn, sample, f"over {self.cfg.timeout_s} s")
        except Exception as e:  # a user's reward code: any failure scores the fallback
            return self._fallback("error", fn, sample, f"{type(e).__name__}: {e}")
        try:
            return to_reward(raw)
        except (ValueError, TypeError) as e:
            return self._fallback("invalid", fn, sample, str(e))

    async def _run(self, fn: RewardFn, sample: RewardInput) -> Any:
        """One call in a slot; a sync call runs in its own daemon thread (a hung judge cannot
        hold the process at exit) and keeps its slot until it really returns."""
        await self._slots.acquire()
        if fn.is_async:
            try:
                return await fn.call(sample)
            finally:
                self._slots.release()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        threading.Thread(target=self._in_thread, args=(loop, done, fn, sample), daemon=True,
                         name=f"reward-{fn.name}").start()
        return await done

    def _in_thread(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any],
                   fn: RewardFn, sample: RewardInput) -> None:
        try:
            out, err = fn.call(sample), None
        except Exception as e:  # handed to the awaiting coroutine
            out, err = None, e
        try:
            loop.call_soon_threadsafe(_settle, done, out, err)
            loop.call_soon_threadsafe(self._slots.release)
        except RuntimeError:  # the loop closed while the call ran: nobody waits for it
            pass

    def _fallback(self, reason: str, fn: RewardFn, sample: RewardInput, why: str) -> Reward:
        self._failures.labels(reason).inc()
        self._errors.error(f"reward {fn.name} ({reason}) of prompt {sample.prompt_id}: {why}; "
                           f"scored the fallback {self.cfg.fallback}")
        return Reward(self.cfg.fallback, failure=reason)


def _settle(done: asyncio.Future[Any], out: Any, err: BaseException | None) -> None:
    if done.done():  # the caller timed out and went on
        return
    if err is not None:
        done.set_exception(err)
    else:
        done.set_result(out)
