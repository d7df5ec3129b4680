"""Weight push benchmark (`make bench-weights`): WeightSender -> WeightReceiver vs a raw
broadcast of the same bytes over the same backend, in the same run, between two processes.

  --device cpu  : gloo, sender and receiver on the CPU (default: 256 MB model, 64 MiB buckets)
  --device cuda : NCCL, sender on cuda:0, receiver on cuda:1 (default: ~2.5 GB, 256 MiB buckets)

The model is synthetic: HF-checkpoint-named tensors shaped like a small Qwen3-MoE (per-expert
gate/up/down projections, as vLLM loads them). After the timed pushes the receiver loads the
last push into a model: transformers' Qwen3MoeForCausalLM when transformers is installed, else
a plain torch module with the same parameter names (the output says which). Clocks: both
processes read time.monotonic() (system-wide on Linux); a push is timed from `push()` to the
receiver's return (after commit), a raw broadcast from its first op to the receiver's last.
Runs with torch + this repo only (no vLLM, no megatron). Writes bench-results/weights.json
(cpu) or bench-results/weights_cuda.json (cuda).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.pb.r3flow.v1 import store_pb2  # noqa: E402
from services.common.weight_sync import WeightReceiver, WeightSender  # noqa: E402
from services.common.weight_sync.group import (  # noqa: E402
    broadcast,
    connect_store,
    make_process_group,
)

MB = 1_000_000
EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def moe_config(target_bytes: int, device: str, smoke: bool = False) -> dict:
    """A Qwen3-MoE-like shape; layers are added until the bf16 model reaches target_bytes."""
    if smoke:  # make test's run: tiny widths, a few layers
        c = dict(hidden=128, heads=2, kv_heads=1, head_dim=64, experts=4, moe_inter=64,
                 vocab=1024)
    elif device == "cuda":
        c = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=64, moe_inter=768,
                 vocab=151936)
    else:
        c = dict(hidden=1024, heads=8, kv_heads=2, head_dim=128, experts=32, moe_inter=256,
                 vocab=32768)
    fixed = 2 * c["vocab"] * c["hidden"] * 2
    per_layer = 2 * sum(s[0] * (s[1] if len(s) > 1 else 1) for _, s in _layer_shapes(c, 0))
    c["layers"] = max(1, -(-(target_bytes - fixed) // per_layer))
    return c


def _layer_shapes(c: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    h, q, kv, p = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], \
        f"model.layers.{i}"
    out = [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
           (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
           (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
           (f"{p}.self_attn.q_norm.weight", (c["head_dim"],)),
           (f"{p}.self_attn.k_norm.weight", (c["head_dim"],)),
           (f"{p}.mlp.gate.weight", (c["experts"], h))]
    for e in range(c["experts"]):
        x = f"{p}.mlp.experts.{e}"
        out += [(f"{x}.gate_proj.weight", (c["moe_inter"], h)),
                (f"{x}.up_proj.weight", (c["moe_inter"], h)),
                (f"{x}.down_proj.weight", (h, c["moe_inter"]))]
    return out


def checkpoint_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF checkpoint names and shapes (per-expert, as vLLM's loader takes them)."""
    out = [("model.embed_tokens.weight", (c["vocab"], c["hidden"]))]
    for i in range(c["layers"]):
        out += _layer_shapes(c, i)
    return out + [("model.norm.weight", (c["hidden"],)),
                  ("lm_head.weight", (c["vocab"], c["hidden"]))]


def make_weights(c: dict, device: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype))
            for n, s in checkpoint_shapes(c)]


# ---- receiver side: the model the weights are loaded into -------------------------------

def build_model(c: dict, device: torch.device) -> tuple[torch.nn.Module, str]:
    """transformers' Qwen3-MoE if available, else a plain module with the same names."""
    try:
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    except ImportError:
        return _plain_module(c, device), "plain torch module (transformers not installed)"
    cfg = Qwen3MoeConfig(vocab_size=c["vocab"], hidden_size=c["hidden"],
                         intermediate_size=4 * c["hidden"], moe_intermediate_size=c["moe_inter"],
                         num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                         num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                         num_experts=c["experts"], num_experts_per_tok=4,
                         tie_word_embeddings=False)
    import transformers
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model, f"transformers {transformers.__version__} {type(model).__name__}"


def _plain_module(c: dict, device: torch.device) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, shape in checkpoint_shapes(c):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(
            torch.empty(shape, dtype=torch.bfloat16, device=device), requires_grad=False))
    return root


def load_named(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> bool:
    """Copy checkpoint-named tensors into the model's parameters (fused experts where the
    model fuses them: gate_up_proj[e] = [gate; up], down_proj[e]); True if all match after."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in named:
            _target(params, name).copy_(t)
    return all(torch.equal(_target(params, n), t) for n, t in named)


def _target(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in params:
        return params[name]
    m = EXPERT.match(name)
    if m is None:
        raise KeyError(f"weights: model has no parameter for {name!r}")
    base, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":
        return params[f"{base}.down_proj"][e]
    gate_up = params[f"{base}.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if kind == "gate" else gate_up[half:]


def _receiver_main(device: str, raw_port: int, cmds: mp.Queue, replies: mp.Queue) -> None:
    torch.set_num_threads(1)  # see run()
    dev = torch.device("cuda:1" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if device == "cuda" else "gloo"
    raw_store = connect_store("127.0.0.1", raw_port, 120, server=False)
    raw_pg = make_process_group(dist.PrefixStore("raw/", raw_store), 1, 2, backend, 300,
                                "127.0.0.1")
    rx, last, model, buf = WeightReceiver("bench-engine", 0, dev), None, None, None
    replies.put(("ready",))
    while (cmd := cmds.get()) is not None:
        if cmd[0] == "raw":
            if buf is None:  # allocated once, like the receiver's staging buffers
                buf = torch.empty(cmd[1], dtype=torch.uint8, device=dev)
            c0 = time.process_time()
            t_end = _raw_broadcast(raw_pg, buf, cmd[2], cmd[3], dev)
            replies.put(("raw", t_end, time.process_time() - c0))
        elif cmd[0] == "push":
            c0, p0 = time.process_time(), _passes()
            last = rx.receive(store_pb2.WeightSyncPlan.FromString(cmd[1]))
            _sync(dev)
            replies.put(("push", time.monotonic(), time.process_time() - c0, _passes(p0)))
        elif cmd[0] == "load":
            t0 = time.monotonic()
            if model is None:
                model, kind = build_model(cmd[1], dev)
            t1 = time.monotonic()
            ok = load_named(model, last.named)
            _sync(dev)
            replies.put(("load", kind, t1 - t0, time.monotonic() - t1, ok))


def _raw_broadcast(pg, buf: torch.Tensor, chunk: int, all_at_once: bool,
                   dev: torch.device) -> float:
    """The baseline: broadcast `buf` in `chunk`-byte pieces, either all posted at once or
    one after the other (the faster of the two is the baseline)."""
    works = []
    for i in range(0, buf.numel(), chunk):
        works.append(broadcast(pg, buf[i: i + chunk]))
        if not all_at_once:
            works[-1].wait()
    for w in works:
        w.wait()
    _sync(dev)
    return time.monotonic()


def _passes(since: dict | None = None) -> dict:
    """The C pack/sum passes' wall seconds and bytes in this process (weight_sync/native.py),
    minus `since`; {} without the C core (GPU machines without numpy)."""
    try:
        from services.common.weight_sync import native
    except ImportError:
        return {}
    now = dict(native.PASSES)
    return {k: v - since.get(k, 0) for k, v in now.items()} if since is not None else now


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- sender side ------------------------------------------------------------------------

def raw_send(pg, buf: torch.Tensor, chunk: int, all_at_once: bool, cmds, replies,
             dev: torch.device) -> tuple[float, tuple[float, float]]:
    """Seconds, and CPU seconds of (sender, receiver) process (all their threads)."""
    cmds.put(("raw", buf.numel(), chunk, all_at_once))
    time.sleep(0.2)  # the receiver posts first, as in a push where engines joined already
    t0, c0 = time.monotonic(), time.process_time()
    _raw_broadcast(pg, buf, chunk, all_at_once, dev)
    cpu = time.process_time() - c0
    kind, t_end, rx_cpu = replies.get(timeout=600)
    return t_end - t0, (cpu, rx_cpu)


def push_once(sender: WeightSender, version: int, named, cmds, replies
              ) -> tuple[float, object, tuple[float, float], dict]:
    """Seconds, the report, CPU seconds of (sender, receiver) and the C passes of each."""
    plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id="bench-engine", world_size=1)])
    cmds.put(("push", plan.SerializeToString()))
    time.sleep(0.2)  # engines get the plan from the store watch while the trainer finishes
    t0, c0, p0 = time.monotonic(), time.process_time(), _passes()
    report = sender.push(plan, named)
    cpu = time.process_time() - c0
    passes = _passes(p0)
    kind, t_end, rx_cpu, rx_passes = replies.get(timeout=600)
    return t_end - t0, report, (cpu, rx_cpu), {"sender": passes, "receiver": rx_passes}


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    result = _run(args)
    # a shared machine: other people's load moves these figures; it is recorded with them
    result["loadavg_1min"] = [load_before, os.getloadavg()[0]]
    return result


def _run(args: argparse.Namespace) -> dict:
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 visible GPUs (sender cuda:0, receiver cuda:1)")
    dev = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    # One intra-op thread per process: with OpenMP's default (one per core) the packing
    # copies spin-wait against the other process and the gloo threads on a small shared
    # machine and stall for seconds; the raw baseline runs no torch ops at all.
    torch.set_num_threads(1)
    _set_pack_stores(args.pack_stores)
    size_mb = args.size_mb or (2500 if cuda else 256)
    bucket = (args.bucket_mb or (256 if cuda else 64)) << 20
    c = moe_config(size_mb * MB, args.device, args.smoke)
    named = make_weights(c, dev.type if not cuda else "cuda", getattr(torch, args.source_dtype))
    cfg = sender_config(backend="nccl" if cuda else "gloo", device=str(dev),
                        wire_dtype=args.wire_dtype, bucket_bytes=bucket, timeout_s=300,
                        inflight_buckets=args.inflight,
                        direct_min_bytes=int(args.direct_min_mb * (1 << 20)) or None)
    sender = WeightSender(cfg)
    raw_store = connect_store("127.0.0.1", 0, 120, server=True)
    ctx = mp.get_context("spawn")
    cmds, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(args.device, raw_store.port, cmds, replies))
    proc.start()
    raw_pg = make_process_group(dist.PrefixStore("raw/", raw_store), 0, 2, cfg.backend, 300,
                                "127.0.0.1")
    assert replies.get(timeout=300)[0] == "ready"
    try:
        return _measure(args, c, named, sender, raw_pg, cmds, replies, dev, bucket)
    finally:
        cmds.put(None)
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()


def _set_pack_stores(kind: str) -> None:
    try:
        from services.common.weight_sync import native
    except ImportError:
        return
    native.STREAM_STORES = kind == "stream"


def sender_config(**fields):
    """The validated WeightSyncConfig; without pydantic (the lent GPU machines), the same
    fields with the config's defaults in a plain namespace (the sender only reads them)."""
    try:
        from services.common.weight_sync import WeightSyncConfig
    except ImportError:
        print("pydantic not installed: using an unvalidated namespace for WeightSyncConfig")
        defaults = dict(direct_min_bytes=None, advertise_addr="127.0.0.1",
                        port=0, heartbeat_interval_s=0.25, heartbeat_timeout_s=3.0)
        return SimpleNamespace(**(defaults | fields))
    return WeightSyncConfig(**fields)


def _measure(args, c, named, sender, raw_pg, cmds, replies, dev, bucket) -> dict:
    push_s, raw_all_s, raw_seq_s, phases, passes, report = [], [], [], [], [], None
    cpu: dict[str, list[tuple[float, float]]] = {"push": [], "raw_all": [], "raw_seq": []}
    raw_buf = None
    for rep in range(args.repeats + 1):  # rep 0 warms up (group setup, buffers, NCCL init)
        t_push, report, c_push, p_push = push_once(sender, rep + 1, named, cmds, replies)
        if raw_buf is None:
            raw_buf = torch.empty(report.num_bytes, dtype=torch.uint8, device=dev)
        t_all, c_all = raw_send(raw_pg, raw_buf, bucket, True, cmds, replies, dev)
        t_seq, c_seq = raw_send(raw_pg, raw_buf, bucket, False, cmds, replies, dev)
        if rep:
            push_s.append(t_push)
            raw_all_s.append(t_all)
            raw_seq_s.append(t_seq)
            phases.append(report.phases)
            passes.append(p_push)
            for key, used in (("push", c_push), ("raw_all", c_all), ("raw_seq", c_seq)):
                cpu[key].append(used)
    raw_s = min((raw_all_s, raw_seq_s), key=statistics.median)
    raw_cpu = cpu["raw_all"] if raw_s is raw_all_s else cpu["raw_seq"]
    cmds.put(("load", c))
    _, model_kind, build_s, load_s, load_ok = replies.get(timeout=900)
    nbytes = report.num_bytes
    push_med, raw_med = statistics.median(push_s), statistics.median(raw_s)
    return {
        "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
        "machine": _machine(args.device), "torch": torch.__version__,
        "model": c, "num_tensors": report.num_tensors, "num_buckets": report.num_buckets,
        "bucket_bytes": bucket, "inflight_buckets": args.inflight,
        "direct_min_mb": args.direct_min_mb, "wire_dtype": args.wire_dtype, "source_dtype": args.source_dtype,
        "push_bytes": nbytes, "repeats": args.repeats,
        "push_s": push_s, "raw_all_at_once_s": raw_all_s, "raw_one_by_one_s": raw_seq_s,
        # sender-side seconds from push() to each step (WeightSender's PushReport.phases)
        "push_phases_s_median": {k: statistics.median(p[k] for p in phases)
                                 for k in (phases[0] if phases else {})},
        # per push, each side's C passes (pack = copy + sum, sum = sums alone): median wall
        # ms and GB/s of those bytes
        "passes_median": {f"{side}_{k}": statistics.median(
            p[side][k] * (1e3 if k.endswith("_s") else 1e-9) for p in passes)
            for side in ("sender", "receiver") for k in (passes[0][side] if passes else {})},
        "pack_stores": args.pack_stores,
        "raw_s": raw_s, "push_s_median": push_med, "raw_s_median": raw_med,
        # CPU seconds per operation of each process (all its threads: gloo's included)
        "cpu_s_median": {f"{op}_{side}": statistics.median(c[i] for c in runs)
                         for op, runs in (("push", cpu["push"]), ("raw", raw_cpu))
                         for i, side in enumerate(("sender", "receiver"))},
        "push_gb_s": nbytes / push_med / 1e9, "raw_gb_s": nbytes / raw_med / 1e9,
        "ratio_to_raw": raw_med / push_med, "target_ratio": 0.8,
        "load_model": model_kind, "model_build_s": build_s, "load_s": load_s,
        "load_verified": load_ok,
    }


def _machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"{platform.machine()}, {os.cpu_count()} cores"


def print_table(r: dict) -> None:
    print(f"\nweight push ({r['backend']}, {r['machine']}, torch {r['torch']}, "
          f"load avg {r['loadavg_1min'][0]:.1f} -> {r['loadavg_1min'][1]:.1f})")
    print(f"model: {r['num_tensors']} HF tensors, {r['push_bytes'] / MB:.0f} MB on the wire "
          f"({r['wire_dtype']}), {r['num_buckets']} buckets of {r['bucket_bytes'] >> 20} MiB")
    print(f"{'':<22}{'median s':>10}{'GB/s':>10}")
    nb = r["push_bytes"]
    for label, key in (("raw, all posted", "raw_all_at_once_s"), ("raw, one by one", "raw_one_by_one_s")):
        med = statistics.median(r[key])
        print(f"{label:<22}{med:>10.3f}{nb / med / 1e9:>10.2f}")
    print(f"{'WeightSender.push':<22}{r['push_s_median']:>10.3f}{r['push_gb_s']:>10.2f}")
    steps = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["push_phases_s_median"].items())
    print(f"push steps on the sender (median ms after push()): {steps}")
    ps = r["passes_median"]
    if ps:
        print("C passes per push (median wall ms / GB): " + ", ".join(
            f"{side} {kind} {ps[f'{side}_{kind}_s']:.1f} / {ps[f'{side}_{kind}_bytes']:.3f}"
            for side in ("sender", "receiver") for kind in ("pack", "sum")
            if ps.get(f"{side}_{kind}_bytes")) + f" (pack stores: {r['pack_stores']})")
    c = r["cpu_s_median"]
    print(f"CPU ms per op (median, whole process): push sender {c['push_sender'] * 1e3:.1f} / "
          f"receiver {c['push_receiver'] * 1e3:.1f}, raw sender {c['raw_sender'] * 1e3:.1f} / "
          f"receiver {c['raw_receiver'] * 1e3:.1f}")
    print(f"ratio_to_raw = {r['ratio_to_raw']:.2f} vs the faster raw "
          f"(target >= {r['target_ratio']})")
    print(f"loaded into: {r['load_model']} in {r['load_s']:.2f} s "
          f"(build {r['model_build_s']:.1f} s), verified={r['load_verified']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size-mb", type=int, default=0, help="model size (default 256 / 2500)")
    ap.add_argument("--bucket-mb", type=int, default=0, help="MiB (default 64 cpu / 256 cuda)")
    ap.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--source-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--inflight", type=int, default=2, help="WeightSyncConfig.inflight_buckets")
    ap.add_argument("--direct-min-mb", type=float, default=0,
                    help="WeightSyncConfig.direct_min_bytes in MiB (0: the default, bucket/2)")
    ap.add_argument("--pack-stores", choices=["stream", "plain"], default="stream",
                    help="the CPU pack's stores: non-temporal (default) or plain (cached)")
    ap.add_argument("--repeats", type=int, default=15,
                    help="pushes and raw broadcasts, interleaved; medians are compared")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="make test's run: a 2 MB model of "
                    "tiny widths, 1 MiB buckets, one push (the keys, not the figures)")
    args = ap.parse_args()
    if args.smoke:
        args.size_mb, args.bucket_mb, args.repeats = 2, 1, 1
    result = run(args) | {"smoke": args.smoke}
    print_table(result)
    out = Path(args.out or f"bench-results/weights{'_cuda' if args.device == 'cuda' else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
