"""A torch.profiler chrome trace (`bench_megatron_parallel.py --profile` writes
`*.trace_r3*.json.gz`) as a short text table (issue 55): GPU busy / idle share of the profiled
step, the gaps between kernels (count, total, the large ones), the top kernels by time, the host
syncs, and GPU time by where each kernel was launched (the innermost Python frame or op that a
rule below names; backward kernels by their autograd node).

Run: python tests/bench/trace_summary.py TRACE.json[.gz] [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "python_function", "user_annotation")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "cudaMemcpyAsync")
# (category, regex on a launching frame's name), tried innermost frame first
RULES = (
    ("permute (dispatch)", r"moe_utils\.py\(\d+\): permute|dispatch_preprocess|token_dispatch\b"),
    ("unpermute (combine)", r"moe_utils\.py\(\d+\): unpermute|combine_postprocess|token_combine"),
    ("experts (grouped)", r"grouped_experts\.py"),
    ("router", r"router\.py|grouped_router"),
    ("loss log-softmax", r"logprobs_triton|logprobs\.py|losses\.py"),
    ("logits [S,B,V]->[B,S,V]", r"gpt_model\.py\(\d+\): _postprocess|batch_first_logits"),
    ("attention core", r"fused_attention\.py|scaled_dot_product"),
    ("rope", r"rope|rotary"),
    ("norm", r"norm"),
    ("optimizer", r"optimizer|[Aa]dam|clip_grad|zero_grad|multi_tensor|grad_norm"),
    ("replay / agreement / plan", r"replay|agreement|planned_dispatch"),
    ("linear (megatron layers)", r"tensor_parallel/layers\.py"),
    ("data / batch", r"trainer/samples|micro_batch|MicroBatch"),
)
BWD = re.compile(r"autograd::engine::evaluate_function: (\w+)")


def _load(path: str) -> list[dict]:
    raw = Path(path).read_bytes()
    data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
    return [e for e in data.get("traceEvents", data) if e.get("ph") == "X"]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _stacks(host: list[dict], launches: list[dict]) -> dict[int, list[str]]:
    """correlation id -> names of the host events enclosing its launch, outermost first."""
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    out: dict[int, list[str]] = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        mine = sorted((x for x in launches if x["tid"] == tid), key=lambda x: x["ts"])
        stack: list[dict] = []
        i = 0
        for x in mine:
            while i < len(evs) and evs[i]["ts"] <= x["ts"]:
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= evs[i]["ts"]:
                    stack.pop()
                stack.append(evs[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < x["ts"]:
                stack.pop()
            corr = x.get("args", {}).get("correlation")
            if corr is not None:
                out[corr] = [s["name"] for s in stack if s["ts"] + s.get("dur", 0) >= x["ts"]]
    return out


def _category(names: list[str]) -> str:
    for name in reversed(names):
        for cat, rx in RULES:
            if re.search(rx, name):
                return cat
    for name in names:
        m = BWD.search(name)
        if m:
            return f"bwd node {m.group(1)}"
    inner = [n for n in names if not n.startswith(("cuda", "Runtime"))]
    return f"other: {inner[-1][:60]}" if inner else "other: (no host frame)"


def summarise(path: str, top: int = 25) -> str:
    ev = _load(path)
    gpu = [e for e in ev if e.get("cat") in GPU_CATS]
    if not gpu:
        return f"{path}: no device events"
    host = [e for e in ev if e.get("cat") in HOST_CATS]
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    t0 = min(e["ts"] for e in ev)
    wall = (max(e["ts"] + e.get("dur", 0) for e in ev) - t0) / 1e3
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    busy_ms = sum(b - a for a, b in busy) / 1e3
    gaps = sorted((b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)), reverse=True)
    span = (busy[-1][1] - busy[0][0]) / 1e3
    lines = [f"== {Path(path).name}",
             f"wall {wall:.1f} ms; kernel span {span:.1f} ms; GPU busy {busy_ms:.1f} ms; idle "
             f"{wall - busy_ms:.1f} ms ({(wall - busy_ms) / wall:.1%} of the wall), inside the "
             f"span {span - busy_ms:.1f} ms",
             f"device events {len(gpu)}; gaps {len(gaps)} totalling {sum(gaps) / 1e3:.1f} ms; "
             f"> 20 us: {sum(g > 20 for g in gaps)} ({sum(g for g in gaps if g > 20) / 1e3:.1f} "
             f"ms); > 100 us: {sum(g > 100 for g in gaps)} "
             f"({sum(g for g in gaps if g > 100) / 1e3:.1f} ms); largest "
             f"{[round(g / 1e3, 2) for g in gaps[:6]]} ms"]
    sync = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if e["name"] in SYNCS:
            sync[e["name"]][0] += 1
            sync[e["name"]][1] += e.get("dur", 0) / 1e3
    lines.append("host syncs / copies: " + ", ".join(
        f"{k} x{n} {ms:.1f} ms" for k, (n, ms) in sorted(sync.items())) if sync else
        "host syncs / copies: none")
    by_kernel = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by_kernel[e["name"][:90]][0] += 1
        by_kernel[e["name"][:90]][1] += e["dur"] / 1e3
    lines.append(f"-- top {top} kernels by GPU time (count, ms, share of busy)")
    for name, (n, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{ms:8.2f} ms {n:6d}  {ms / busy_ms:6.1%}  {name}")
    stacks = _stacks(host, [e for e in runtime if "args" in e])
    by_cat = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        cat = _category(stacks.get(e.get("args", {}).get("correlation"), []))
        by_cat[cat][0] += 1
        by_cat[cat][1] += e["dur"] / 1e3
    lines.append("-- GPU time by where it was launched (kernels, ms, share of busy)")
    for cat, (n, ms) in sorted(by_cat.items(), key=lambda kv: -kv[1][1])[:top + 10]:
        lines.append(f"{ms:8.2f} ms {n:6d}  {ms / busy_ms:6.1%}  {cat}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    for t in args.traces:
        print(summarise(t, args.top))


if __name__ == "__main__":
    main()
