"""Streamed weight push at real size (issue 29): megatron trainer ranks on two GPUs (EP2, or PP2)
stream their HF export (trainer.megatron.export_stream) through rank 0's WeightSender over NCCL
to two receiver processes on two other GPUs, which load each bucket into an HF model as it lands
(weight_sync.receiver_stream) and then check every tensor's checksum against the trainer's.

Model: Qwen3-30B-A3B (full widths, 48 layers; `--layers` for fewer), random weights built on the
GPUs (no checkpoint), bf16. Per layout, in one run: a raw NCCL broadcast of the push's bytes in
bucket-size pieces (rank 0 -> both receivers: the baseline), push 1 (checksums recorded and
verified after the load), raw again, push 2 (timed). Reported: push seconds, raw seconds, their
ratio, and each process's peak GPU memory during the push above what it held before, against its
bucket budget (sender: inflight + chunk depth + one bucket of sources; non-sender: chunk depth;
receiver: ring slots).
Run: python tests/bench/bench_push_stream.py --layout ep2 [--layout pp2] (4 GPUs);
     python tests/bench/bench_push_stream.py --smoke   (CPU, gloo, tiny widths)
Writes bench-results/push_stream.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "bench"))
from services.common.net import free_port  # noqa: E402

LAYOUTS = {"ep2": {"expert_parallel": 2}, "pp2": {"pipeline_parallel": 2}}
GIB = 1 << 30


def hf_config(args: argparse.Namespace) -> dict:
    from trainer.plan.models import load_model_config

    cfg = dict(load_model_config("Qwen3-30B-A3B"), num_hidden_layers=args.layers)
    if args.smoke:
        cfg |= {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": 512, "intermediate_size": 128}
    return cfg


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _mem() -> tuple[int, int]:
    return (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) \
        if torch.cuda.is_available() else (0, 0)


def _wait_file(path: Path, timeout: float = 900) -> bytes:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.05)
    time.sleep(0.05)
    return path.read_bytes()


def _raw_group(rank: int, port: int, server: bool):
    from services.common.weight_sync.group import connect_store, make_process_group

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = connect_store("127.0.0.1", port, 600, server=server)
    return store, make_process_group(dist.PrefixStore("raw/", store), rank, 3, backend, 600,
                                     "127.0.0.1")


def raw_broadcast(pg, nbytes: int, bucket: int, ring: list[torch.Tensor]) -> float:
    """Seconds to broadcast `nbytes` from rank 0 in `bucket` pieces (through a 2-buffer ring),
    ended by a tiny all-reduce that completes only once every member got every piece."""
    from services.common.weight_sync.group import broadcast

    _sync()
    t0 = time.perf_counter()
    works = [broadcast(pg, ring[k % 2][: min(bucket, nbytes - i)])
             for k, i in enumerate(range(0, nbytes, bucket))]
    for w in works:
        w.wait()
    pg.allreduce([torch.zeros(1, device=ring[0].device)]).wait()
    _sync()
    return time.perf_counter() - t0


def raw_p2p(nbytes: int, bucket: int) -> float:
    """Seconds for rank 1 to send `nbytes` to rank 0 point-to-point in `bucket` pieces, all
    posted at once (what the export's chunks cross at best), best of two."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ring = [torch.empty(bucket, dtype=torch.uint8, device=dev) for _ in range(2)]
    best = float("inf")
    for _ in range(2):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        op = dist.isend if dist.get_rank() == 1 else dist.irecv
        peer = 1 - dist.get_rank()
        works = [op(ring[k % 2][: min(bucket, nbytes - i)], peer)
                 for k, i in enumerate(range(0, nbytes, bucket))]
        for w in works:
            w.wait()
        _sync()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


# ---- trainer ranks -------------------------------------------------------------------------
def build_megatron(args: argparse.Namespace, layout: str):
    """Megatron GPTModel at the config's size, parameters allocated and filled on the device."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from trainer.megatron.config import ModelConfig
    from trainer.megatron.hf_mapping import arch_from_hf_config
    from trainer.megatron.model import init_parallel, rope_kwargs, transformer_config
    from trainer.megatron.spec import decoder_spec

    cfg = ModelConfig(dtype="bf16", router_dtype="native", **LAYOUTS[layout])
    init_parallel(cfg)
    arch = arch_from_hf_config(hf_config(args))
    tcfg = replace(transformer_config(arch, cfg), use_cpu_initialization=False,
                   perform_initialization=False)
    module = GPTModel(config=tcfg, transformer_layer_spec=decoder_spec(tcfg, arch.fam),
                      vocab_size=arch.vocab_size, max_sequence_length=arch.max_positions,
                      pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                      share_embeddings_and_output_weights=False, **rope_kwargs(arch))
    module = module.bfloat16()
    if torch.cuda.is_available():
        module = module.cuda()
    g = torch.Generator(next(module.parameters()).device).manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02, generator=g)
    return module, arch, tcfg


def checksum(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).sum(dtype=torch.int64)


def trainer_rank(args: argparse.Namespace, layout: str, work: Path) -> dict:
    from services.common.pb.r3flow.v1 import store_pb2
    from services.common.weight_sync import WeightSender, WeightSyncConfig
    from trainer.megatron.export_stream import HFStream

    module, arch, tcfg = build_megatron(args, layout)
    rank, bucket = dist.get_rank(), args.bucket_mb << 20
    out: dict = {"rank": rank, "model_bytes": sum(p.numel() * 2 for p in module.parameters())}

    # the layout (one all_gather_object) is worked out once, as the trainer keeps it
    hf_stream = HFStream(module, arch, tcfg.gated_linear_unit, sender=0, chunk_bytes=bucket,
                         wire=torch.bfloat16, depth=args.depth)
    provided = sum(c.nbytes for cs in hf_stream.chunks.values() for c in cs if c.src == 1)
    out["raw_p2p_s"] = raw_p2p(provided, bucket)  # rank 1 -> rank 0, the chunks' bytes
    out["p2p_bytes"] = provided

    def stream():
        return hf_stream.packed() if args.mode == "packed" else iter(hf_stream)

    if rank:
        for push in (1, 2):
            _sync()
            base, _ = _mem()
            torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
            for _ in stream():
                pass
            _sync()
            out[f"push{push}_extra"] = _mem()[1] - base
            out["peak_inflight"] = hf_stream.peak_inflight
        return out
    cuda = torch.cuda.is_available()
    sender = WeightSender(WeightSyncConfig(
        backend="nccl" if cuda else "gloo", device="cuda" if cuda else "cpu", bucket_bytes=bucket,
        timeout_s=600, heartbeat_interval_s=0.5, heartbeat_timeout_s=30))
    raw_store, raw_pg = _raw_group(0, args.raw_port, server=True)
    dev = torch.device("cuda" if cuda else "cpu")
    ring = [torch.empty(bucket, dtype=torch.uint8, device=dev) for _ in range(2)]
    workers = [store_pb2.WorkerInfo(worker_id=f"rx{i}", host="127.0.0.1", world_size=1)
               for i in range(2)]
    for push in (1, 2):
        plan = sender.plan(push, workers)
        (work / f"plan{push}.tmp").write_bytes(plan.SerializeToString())
        os.replace(work / f"plan{push}.tmp", work / f"plan{push}.bin")
        time.sleep(0.3)  # engines get the plan from the store watch while the trainer steps
        sums: dict[str, torch.Tensor] = {}

        _sync()
        base, _ = _mem()
        torch.cuda.reset_peak_memory_stats() if cuda else None
        t0 = time.perf_counter()
        hf_stream.host_wait_s = 0.0
        with profiled(args.profile and push == 2, Path(args.out).with_suffix(f".{layout}.prof")):
            report = sender.push(plan, recording(stream(), sums if push == 1 else None))
        out["host_wait_s"] = hf_stream.host_wait_s
        out[f"push{push}_s"] = time.perf_counter() - t0
        out[f"push{push}_extra"] = _mem()[1] - base
        out[f"push{push}_phases"] = report.phases | {
            f"host_{k}": v for k, v in report.host_s.items()}
        out |= {"num_bytes": report.num_bytes, "num_tensors": report.num_tensors,
                "num_buckets": report.num_buckets}
        if push == 1:
            (work / "sums.json").write_text(json.dumps({n: int(v) for n, v in sums.items()}))
            del sums
        (work / f"bytes{push}.txt").write_text(str(report.num_bytes))
        out[f"raw{push}_s"] = raw_broadcast(raw_pg, report.num_bytes, bucket, ring)
    sender.close()
    return out


@contextlib.contextmanager
def profiled(on: bool, path: Path) -> Iterator[None]:
    """torch.profiler around the block (CPU + CUDA); its op tables written to `path`."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, with_stack=True) as prof:
        yield
        _sync()
    ka = prof.key_averages()
    # where the host blocks: the Python stacks of every synchronising CUDA runtime call
    where: dict[tuple[str, ...], list[float]] = {}
    for e in prof.events():
        if "Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaHostAlloc"):
            op, names = e.cpu_parent, [e.name]
            while op is not None and not op.stack:
                names.append(op.name)
                op = op.cpu_parent
            key = (" < ".join(names + ([op.name] if op else [])),
                   *(op.stack[:12] if op else ()))
            where.setdefault(key, []).append(e.cpu_time_total)
    stacks = "\n\n".join(f"x{len(t)} {sum(t):.0f} us {k[0]}\n  " + "\n  ".join(k[1:])
                         for k, t in sorted(where.items(), key=lambda kv: -sum(kv[1])))
    path.write_text(ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n"
                    + ka.table(sort_by="self_device_time_total", row_limit=20)
                    + "\n\nsynchronising calls by stack:\n" + stacks)


def recording(stream, sums: dict[str, torch.Tensor] | None):
    """`stream` (tensors or packed buckets) passed through, each tensor's checksum kept in
    `sums`; None: the stream itself, untouched (the timed push)."""
    from services.common.weight_sync import buckets as bk

    if sums is None:
        yield from stream
        return
    for item in stream:
        if isinstance(item, bk.PackedBucket):
            views = bk.bucket_views(item.buffer, list(item.entries))
            sums |= {e.name: checksum(v) for e, v in zip(item.entries, views, strict=True)}
        else:
            sums[item[0]] = checksum(item[1])
        yield item


# ---- receivers -----------------------------------------------------------------------------
def receiver(args: argparse.Namespace, index: int, work: Path) -> dict:
    from bench_weights import _target  # the HF model's parameter for a checkpoint name
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from services.common.pb.r3flow.v1 import store_pb2
    from services.common.weight_sync import WeightReceiver
    from services.common.weight_sync.receiver_stream import DEFAULT_SLOTS, stream_weights

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {k: v for k, v in hf_config(args).items() if k != "model_type"}
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    rx = WeightReceiver(f"rx{index}", 0, dev)
    _, raw_pg = _raw_group(index + 1, args.raw_port, server=False)
    ring = [torch.empty(args.bucket_mb << 20, dtype=torch.uint8, device=dev) for _ in range(2)]
    slots = args.slots or DEFAULT_SLOTS
    out: dict = {"index": index, "slots": slots}
    targets: dict[str, torch.Tensor] = {}
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for push in (1, 2):
        plan = store_pb2.WeightSyncPlan.FromString(_wait_file(work / f"plan{push}.bin"))
        _sync()
        base, _ = _mem()
        torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
        names = []
        with torch.no_grad():
            bucket = None
            t_loop, own = time.perf_counter(), 0.0
            for name, t in stream_weights(rx, plan, slots):
                t_own = time.perf_counter()
                if name not in targets:  # looked up once: the names repeat every push
                    targets[name] = _target(params, name)
                if t.untyped_storage().data_ptr() != bucket and dst:
                    torch._foreach_copy_(dst, src)  # one copy per bucket, inside its life
                    dst, src = [], []
                bucket = t.untyped_storage().data_ptr()
                dst.append(targets[name])
                src.append(t)
                names.append(name)
                own += time.perf_counter() - t_own
            out[f"push{push}_loop_s"] = time.perf_counter() - t_loop
            out[f"push{push}_loader_s"] = own  # the loader's own Python per tensor
            if dst:
                torch._foreach_copy_(dst, src)
                dst, src = [], []
        _sync()
        out[f"push{push}_extra"] = _mem()[1] - base
        if push == 1:
            want = json.loads(_wait_file(work / "sums.json"))
            got = {n: int(checksum(_target(params, n))) for n in names}
            out["checked"] = len(got)
            out["bad"] = sorted(n for n in want if got.get(n) != want[n])[:5]
            out["missing"] = len(set(want) - set(got))
        raw_broadcast(raw_pg, int(_wait_file(work / f"bytes{push}.txt")),
                      args.bucket_mb << 20, ring)
    return out


# ---- driver ------------------------------------------------------------------------------
def run_layout(args: argparse.Namespace, layout: str) -> dict:
    """The 4 processes of one layout; returns their reports."""
    work = Path(tempfile.mkdtemp(prefix=f"push_{layout}_"))
    master, raw = free_port(), free_port()
    procs = []
    for role in ("t0", "t1", "r0", "r1"):
        gpu = {"t0": 0, "t1": 1, "r0": 2, "r1": 3}[role]
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
            "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        env["CUDA_VISIBLE_DEVICES"] = "" if args.smoke else str(gpu)
        if role.startswith("t"):
            env |= {"RANK": role[1], "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
        cmd = [sys.executable, __file__, *sys.argv[1:], "--role", role, "--work", str(work),
               "--raw-port", str(raw), "--layout", layout]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if codes != [0] * 4:
        raise SystemExit(f"{layout}: exit codes {codes}")
    return {role: json.loads((work / f"{role}.json").read_text())
            for role in ("t0", "t1", "r0", "r1")}


def summarize(layout: str, r: dict, bucket: int) -> dict:
    """The figures of one layout, with each process's budget (see the module docstring)."""
    t0, t1 = r["t0"], r["t1"]
    push_s, raw_s = t0["push2_s"], min(t0["raw1_s"], t0["raw2_s"])
    budgets = {"t0": (2 + 3 + 1) * bucket, "t1": 3 * bucket, "r0": 3 * bucket, "r1": 3 * bucket}
    peaks = {k: max(r[k]["push1_extra"], r[k]["push2_extra"]) for k in budgets}
    return {"layout": layout, "bytes": t0["num_bytes"], "tensors": t0["num_tensors"],
            "buckets": t0["num_buckets"], "push_s": push_s, "push1_s": t0["push1_s"],
            "phases": t0["push2_phases"],
            "raw_s": raw_s, "ratio": raw_s / push_s, "gb_s": t0["num_bytes"] / push_s / 1e9,
            "p2p_bytes": t0["p2p_bytes"], "raw_p2p_s": t0["raw_p2p_s"],
            "rx_loop_s": [r[k]["push2_loop_s"] for k in ("r0", "r1")],
            "rx_loader_s": [r[k]["push2_loader_s"] for k in ("r0", "r1")],
            "sender_host_wait_s": t0["host_wait_s"],
            "model_bytes_per_trainer_rank": [t0["model_bytes"], t1["model_bytes"]],
            "peak_extra_gib": {k: v / GIB for k, v in peaks.items()},
            "over_budget_gib": {k: (peaks[k] - budgets[k]) / GIB for k in budgets},
            "checked": [r["r0"]["checked"], r["r1"]["checked"]],
            "bad": r["r0"]["bad"] + r["r1"]["bad"],
            "missing": r["r0"]["missing"] + r["r1"]["missing"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", action="append", choices=sorted(LAYOUTS))
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--depth", type=int, default=2, help="export chunks in flight per rank")
    p.add_argument("--slots", type=int, default=0, help="receiver ring slots (0: default)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler around the sender's timed push (tables beside --out)")
    p.add_argument("--mode", choices=("packed", "tensors"), default="packed",
                   help="the sender takes whole chunks (the trainer's push) or tensor by tensor")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny widths, 2 layers")
    p.add_argument("--timeout", type=float, default=560)
    p.add_argument("--out", default=str(REPO / "bench-results" / "push_stream.json"))
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--raw-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.bucket_mb = min(args.layers, 2), 1
    if args.role:
        layout, work = args.layout[-1], Path(args.work)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        report = trainer_rank(args, layout, work) if args.role.startswith("t") else \
            receiver(args, int(args.role[1]), work)
        (work / f"{args.role}.json").write_text(json.dumps(report))
        if args.role.startswith("t"):
            dist.barrier()
            dist.destroy_process_group()
        return
    rows = [summarize(lay, run_layout(args, lay), args.bucket_mb << 20)
            for lay in (args.layout or ["ep2"])]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke \
        else "cpu"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "layers": args.layers,
                                          "mode": args.mode,
                                          "bucket_mb": args.bucket_mb, "rows": rows}, indent=1))
    print(f"device {device}, {args.layers} layers, {args.bucket_mb} MiB buckets, "
          f"sender takes {args.mode}, depth {args.depth}, receiver slots "
          f"{args.slots or 'default'}")
    print(f"{'layout':7} {'GB':>7} {'push s':>7} {'raw s':>7} {'ratio':>6} {'GB/s':>6}  "
          "peak extra GiB (t0 t1 r0 r1) / over budget  checked bad")
    for r in rows:
        pk, ob = r["peak_extra_gib"], r["over_budget_gib"]
        print(f"{r['layout']:7} {r['bytes'] / 1e9:7.2f} {r['push_s']:7.3f} {r['raw_s']:7.3f} "
              f"{r['ratio']:6.3f} {r['gb_s']:6.1f}  "
              + " ".join(f"{pk[k]:.2f}" for k in ("t0", "t1", "r0", "r1")) + " / "
              + " ".join(f"{ob[k]:+.2f}" for k in ("t0", "t1", "r0", "r1"))
              + f"  {r['checked']} {len(r['bad'])}  p2p {r['p2p_bytes'] / 1e9:.1f} GB in "
              f"{r['raw_p2p_s']:.3f} s; rx loop {r['rx_loop_s'][0]:.3f} s, loader "
              f"{r['rx_loader_s'][0]:.3f} s; sender host waits {r['sender_host_wait_s']:.3f} s; "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items()))


if __name__ == "__main__":
    main()
