"""Routing delivered at a call's end against vLLM's per-step delivery (issue 53): the pieces
of bench_vllm_gpu.py's `delivery` subcommand and of its `engine` self-checks.

- `delivery_equality`: each prompt twice in one batch, its routing delivered per step
  (`CallParams.routing_delivery="step"`, vLLM's own path) and at finish; calls whose tokens
  agree must have byte-equal rows.
- `cut_equality`: the same, cut by the weight update's pause mid-generation: each call keeps
  its rows up to the cut, and the two deliveries agree on the rows both hold.
- `Baton`: bench processes started together on one machine (their engine starts overlap) take
  turns measuring, none while another still starts its engines.
- `interleaved_rounds`: rounds of (label, engine, delivery) conditions, forward order on even
  repeats and backward on odd ones, as many repeats as fit before a deadline; `summary`: the
  median tokens/s of each condition per batch and their ratios to `no_capture`.
Legend: T rows, L layers, K top-k.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _same_rows(step: Any, finish: Any, n_tokens: int) -> tuple[int, int]:
    """(rows compared, rows equal) of two calls of one prompt over their first `n_tokens`
    generated tokens' rows (and the prompt's)."""
    a, b = step.routing_TLK, finish.routing_TLK
    if a is None or b is None or a.dtype != b.dtype:
        return 0, 0
    rows = min(a.shape[0] - len(step.token_ids), b.shape[0] - len(finish.token_ids)) + n_tokens
    eq = (a[:rows] == b[:rows]).reshape(rows, -1).all(axis=1)
    return rows, int(eq.sum())


async def _both(engine: Any, tag: str, prompts: Sequence[list[int]], params: Any,
                started: Callable[[list[str]], Any] | None = None) -> list[tuple[Any, Any]]:
    calls, rids = [], []
    for i, p in enumerate(prompts):
        for d in ("step", "finish"):
            rids.append(f"{tag}-{d}-{i}")
            calls.append(asyncio.ensure_future(engine.generate(
                rids[-1], p, dataclasses.replace(params, routing_delivery=d))))
    if started is not None:
        await started(rids)
    outs = await asyncio.gather(*calls)
    return list(zip(outs[::2], outs[1::2], strict=True))


def _tally(pairs: list[tuple[Any, Any]], prefix_only: bool) -> dict[str, Any]:
    res = {"calls": len(pairs), "calls_same_tokens": 0, "rows_compared": 0, "rows_equal": 0}
    for step, finish in pairs:
        n = min(len(step.token_ids), len(finish.token_ids))
        same = step.token_ids[:n] == finish.token_ids[:n] and (
            prefix_only or len(step.token_ids) == len(finish.token_ids))
        if not same:
            continue
        res["calls_same_tokens"] += 1
        rows, eq = _same_rows(step, finish, n)
        res["rows_compared"] += rows
        res["rows_equal"] += eq
    res["equal"] = res["rows_compared"] > 0 and res["rows_equal"] == res["rows_compared"]
    return res


async def delivery_equality(engine: Any, prompts: Sequence[list[int]], params: Any
                            ) -> dict[str, Any]:
    """Per-step vs at-finish rows of the same calls, run side by side in one batch."""
    return _tally(await _both(engine, "deq", prompts, params), prefix_only=False)


async def cut_equality(engine: Any, prompts: Sequence[list[int]], params: Any,
                       min_tokens: int = 8) -> dict[str, Any]:
    """`delivery_equality` with the calls aborted by a weight-update pause (no new weights)
    once each has `min_tokens` tokens: rows up to the cut, on both deliveries."""
    async def pause_when_generating(rids: list[str]) -> None:
        deadline = time.monotonic() + 120
        while min(engine.progress(r) for r in rids) < min_tokens:
            if time.monotonic() > deadline:
                raise TimeoutError("cut_equality: the calls made no progress")
            await asyncio.sleep(0.005)
        async with engine.pause_for_update():
            pass

    pairs = await _both(engine, "dcut", prompts, params, pause_when_generating)
    res = _tally(pairs, prefix_only=True)
    res["aborted"] = sum(f.finish_reason == "abort" for _, f in pairs)
    res["rows_held"] = all(f.routing_TLK is not None and f.routing_TLK.shape[0]
                           == len(p) + len(f.token_ids) - 1
                           for p, (_, f) in zip(prompts, pairs, strict=True) if f.token_ids)
    return res


class Baton:
    """Peers (bench processes) measure one after another, in `peers` order, once all of them
    are ready (their engines started); files under `folder` carry the turns. A peer that never
    gets ready or never finishes is waited for until `until` (epoch seconds), no longer."""

    def __init__(self, folder: str, name: str, peers: Sequence[str], until: float) -> None:
        self.dir, self.name, self.peers, self.until = Path(folder), name, list(peers), until
        self.dir.mkdir(parents=True, exist_ok=True)

    async def _wait(self, names: Sequence[str], suffix: str) -> None:
        while time.time() < self.until and not all(
                (self.dir / f"{n}.{suffix}").exists() for n in names):
            await asyncio.sleep(0.1)

    async def ready_then_turn(self) -> None:
        (self.dir / f"{self.name}.ready").touch()
        await self._wait(self.peers, "ready")
        await self._wait(self.peers[:self.peers.index(self.name)], "done")

    def done(self) -> None:
        """This peer is through (measured, or failed: then it never gets ready, and must not
        be waited for)."""
        (self.dir / f"{self.name}.ready").touch()
        (self.dir / f"{self.name}.done").touch()


async def interleaved_rounds(conds: Sequence[tuple[str, Any, str | None]], batches: list[int],
                             round_fn: Callable[..., Any], until: float, max_repeats: int,
                             on_repeat: Callable[[list[dict]], None]) -> list[dict]:
    """Repeats of every condition at every batch (`round_fn(engine, tag, batch, delivery)` ->
    a round's dict), until the next repeat would not end by `until`."""
    rounds: list[dict] = []
    longest = 0.0
    for rep in range(max_repeats):
        if rep >= 1 and time.time() + longest > until:
            break
        t0 = time.perf_counter()
        for batch in batches:
            for label, engine, delivery in (conds if rep % 2 == 0 else conds[::-1]):
                r = await round_fn(engine, f"{label}-{batch}-{rep}", batch, delivery)
                r.update(condition=label, rep=rep)
                rounds.append(r)
                print(f"[delivery] {label} batch {batch} rep {rep}: "
                      f"{r['tokens_per_s']:,.0f} tokens/s", flush=True)
        longest = max(longest, time.perf_counter() - t0)
        on_repeat(rounds)
    return rounds


def summary(rounds: list[dict], baseline: str = "no_capture") -> dict[str, Any]:
    """Per batch: each condition's median tokens/s over its rounds, rounds counted, and each
    capture condition's ratio to `baseline` (medians; and of summed tokens / summed seconds)."""
    out: dict[str, Any] = {}
    for batch in sorted({r["batch"] for r in rounds}):
        per: dict[str, list[dict]] = {}
        for r in rounds:
            if r["batch"] == batch:
                per.setdefault(r["condition"], []).append(r)
        med = {c: float(np.median([r["tokens_per_s"] for r in rs])) for c, rs in per.items()}
        tot = {c: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
               for c, rs in per.items()}
        row: dict[str, Any] = {f"{c}_median": round(v, 1) for c, v in med.items()}
        row["rounds"] = {c: len(rs) for c, rs in per.items()}
        if baseline in med:
            for c in med:
                if c != baseline:
                    row[f"{c}_over_{baseline}"] = round(med[c] / med[baseline], 3)
                    row[f"{c}_over_{baseline}_sums"] = round(tot[c] / tot[baseline], 3)
        out[f"batch{batch}"] = row
    return out
