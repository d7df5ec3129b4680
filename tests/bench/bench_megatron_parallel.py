"""Megatron trainer at Qwen3-30B-A3B widths on several GPUs: throughput, MFU, peak memory vs
`r3flow plan`, and the step time of r3 / r2 / off replay, same run (issue 21).

Model: Qwen3-30B-A3B's widths (hidden 2048, 128 experts top-8, expert FFN 768, 32 heads / 4 KV
heads, head dim 128, vocab 151,936) with `--layers` layers, random init (no weights), bf16.
Each rank trains `--samples` sequences of `--seq-len` tokens per step (`--micro-batch` 1); rollout
routing is random distinct ids (r3 replays them; r2 records then replays the policy's own, or routes
the update with it where the old-policy pass is skipped).
Modes run round-robin (off, r3, r2, then the next round) after a warm-up step each, so drift
hits all alike. MFU counts the model FLOPs of the update (6 x active params x tokens +
attention) and of the old-policy forward (2 x ... + attention; not where
loss.skip_old_policy_pass skipped it: `old_pass_skipped` per mode), against the card's dense bf16
peak (`--peak-tflops`, H100/H200 SXM: 989); "MFU dec" leaves the lm head out (decoder only).
The fast path's switches (issue 30): --experts grouped --attention sdpa [--overlap-grad-reduce
--overlap-param-gather --fused-adam --chunked-logprobs [--logprob-kernel torch|triton]
--planned-dispatch --[no-]batch-first-logits]; MoE recompute: --[no-]recompute-moe, by default
`r3flow plan`'s pick for the GPU's memory (issue 44); --check-agreement turns the routing agreement check on (its cost; floor 0:
random rollout ids agree with a random-init router at chance, so no group is quarantined).
--variants "NAME:ARGS;..." builds and times one trainer per variant in turn in the same processes
(issue 55: each switch alone and all together in one short call; one JSON entry per variant).
Writes bench-results/megatron_parallel.json.
Run: python tests/bench/bench_megatron_parallel.py --gpus 4 [--layers 8 --ep 4 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.support.ranks import RanksFailed, run_ranks  # noqa: E402

MODES = ("off", "r3", "r2")


def _hf_config(layers: int, small: bool) -> dict:
    from trainer.plan.models import load_model_config

    cfg = dict(load_model_config("Qwen3-30B-A3B"), num_hidden_layers=layers,
               torch_dtype="bfloat16")
    if small:  # CPU smoke: same structure, tiny widths
        cfg |= {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": 512, "intermediate_size": 128}
    return cfg


def _flops_per_token(cfg: dict, seq: int, lm_head: bool = True) -> float:
    """Forward model FLOPs per token: 2 x active matmul params + causal attention (without the
    lm head's 2 x hidden x vocab when `lm_head` is False: the decoder-only figure)."""
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    attn_params = h * (q + 2 * kv) + q * h
    expert = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"]
    router = h * cfg["num_experts"]
    active = layers * (attn_params + expert + router) + h * cfg["vocab_size"] * lm_head
    attn_scores = layers * 2 * 2 * q * seq / 2  # QK^T and PV, causal half
    return 2 * active + attn_scores


def _samples(n: int, seq: int, moe_layers: int, top_k: int, experts: int, seed: int) -> list:
    from trainer.samples.batch import Sample

    rng = np.random.default_rng(seed)
    out, prompt = [], seq // 4
    for i in range(n):
        ids = np.argsort(rng.random((seq - 1, moe_layers, experts), dtype=np.float32), -1)
        out.append(Sample(rng.integers(4, 500, seq), prompt, np.full(seq - prompt, -2.0, np.float32),
                          np.ones(seq - prompt, bool), float(rng.random()), f"g{i}",
                          routing_TLK=ids[..., :top_k].astype(np.int64), trajectory_id=f"t{i}"))
    return out


def _rank(args: argparse.Namespace, model_dir: str, out: str,
          variants: list[tuple[str, argparse.Namespace]]) -> None:
    """Each variant's trainer built, timed and freed in turn in this one process (imports,
    CUDA context and compiled kernels shared; --variants), its figures written to `out`."""
    import gc

    import torch

    res = {}
    for name, vargs in variants:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        res[name] = _measure(vargs, model_dir, f"{Path(vargs.out).with_suffix('')}"
                             f"{'_' + name if name else ''}.json")
        gc.collect()
        left = 0.0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated() / 2**30
        if torch.distributed.get_rank() == 0:  # as it ends: a run cut short keeps these
            med = {m: round(statistics.median(t), 4) for m, t in res[name]["times"].items()}
            print(f"variant {name or '-'}: build {res[name]['build_s']:.0f} s, steps "
                  f"{res[name]['steps_s']:.0f} s; rank 0 median step s {med}, peak "
                  f"{res[name]['peak_bytes'] / 2**30:.2f} GiB; left allocated after it "
                  f"{left:.2f} GiB", flush=True)
    Path(out).write_text(json.dumps({"variants": res}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _trainer(args: argparse.Namespace, model_dir: str):
    """The bench's trainer for `args` (random init)."""
    import trainer.megatron.engine as engine
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    real_build = getattr(engine.build_model, "real_build", engine.build_model)
    random_init = lambda d, c: real_build(d, c, load_weights=False)  # noqa: E731
    random_init.real_build = real_build  # type: ignore[attr-defined]
    engine.build_model = random_init
    model = {"dtype": "bf16", "expert_parallel": args.ep, "tensor_parallel": args.tp,
             "sequence_parallel": args.tp > 1, "pipeline_parallel": args.pp,
             "recompute_moe": args.recompute_moe, "router_dtype": "native",
             "experts": args.experts, "attention": args.attention}
    if args.planned_dispatch:  # older checkouts lack the field
        model["planned_dispatch"] = True
    if args.batch_first_logits is not None:  # else the field's default (older checkouts lack it)
        model["batch_first_logits"] = args.batch_first_logits
    if args.moe_permute is not None:
        model["moe_permute"] = args.moe_permute
    cfg = TrainerConfig(model_dir=model_dir, model=model, data={"micro_batch_size": args.micro_batch,
                        "pad_multiple": 128}, replay={"check_agreement": args.check_agreement,
                                                  "agreement_floor": 0.0},
                        optim={"lr": 1e-7, "use_distributed_optimizer": args.distributed_optimizer}
                        | _optim_switches(args),
                        loss=({"chunked_logprobs": True} if args.chunked_logprobs else {})
                        | ({"logprob_kernel": args.logprob_kernel}
                           if args.logprob_kernel != "auto" else {})
                        | ({"skip_old_policy_pass": args.skip_old_pass}
                           if args.skip_old_pass else {}))  # else the default (older: absent)
    return make_trainer(cfg)


def _measure(args: argparse.Namespace, model_dir: str, out: str) -> dict:
    """Build the trainer, time the modes round-robin, profile if asked; this rank's figures."""
    import torch

    t_build = time.perf_counter()
    tr = _trainer(args, model_dir)
    b = tr.backend
    samples = _samples(args.samples, args.seq_len, len(b.moe_layers), b.top_k, b.num_experts,
                       torch.distributed.get_rank())
    t_steps = time.perf_counter()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    skipped = dict.fromkeys(MODES, False)  # loss.skip_old_policy_pass took the pass away
    for r in range(args.rounds + 1):
        for mode in MODES:
            if mode == "r2":
                for s in samples:
                    s.routing_TLK = None
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0 = time.perf_counter()
            m = tr.train_step(samples, mode)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            skipped[mode] = bool(m.get("old_pass_skipped"))
            if r:
                times[mode].append(time.perf_counter() - t0)
        samples = _samples(args.samples, args.seq_len, len(b.moe_layers), b.top_k,
                           b.num_experts, torch.distributed.get_rank())
    if args.profile or args.profile_stack:
        _profile(tr, samples, out, args.profile_stack)  # beside the bench's JSON (rank 0)
    if args.cprofile:
        _cprofile(tr, samples)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"times": times, "peak_bytes": peak, "skipped": skipped,
            "rank": torch.distributed.get_rank(), "build_s": t_steps - t_build,
            "steps_s": time.perf_counter() - t_steps}


def _profile(tr, samples: list, out: str, stack: bool = False) -> None:
    """One off and one r3 step under torch.profiler; rank 0 prints the top ops by self CPU and
    by device time and writes them beside `out` (--profile); with `stack` (--profile-stack) a
    third step, r3 with Python stacks (tests/bench/trace_summary.py: GPU time by launching
    frame)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # the third: r3 again with Python stacks (where each kernel was launched from; the host
    # tracing slows the host, so the idle figures come from the plain r3 trace)
    for mode, with_stack in (("off", False), ("r3", False), ("r3", True))[:3 if stack else 2]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=with_stack) as prof:
            tr.train_step(samples, mode)
            torch.cuda.synchronize()
        if with_stack:
            if torch.distributed.get_rank() == 0:
                _export(prof, Path(out).with_suffix(".trace_r3_stack.json"))
            continue
        if torch.distributed.get_rank() == 0:
            avg = prof.key_averages()
            text = "\n".join(f"== {mode} by {key}\n" + avg.table(sort_by=key, row_limit=40,
                                                                   max_name_column_width=60)
                             for key in ("self_cpu_time_total", "self_device_time_total"))
            text += "\n" + _busy_line(prof, mode)
            Path(out).with_suffix(f".profile_{mode}.txt").write_text(text)
            print(text)
            if mode == "r3":  # the timeline, for gaps the tables cannot show (gzip: < 16 MiB)
                _export(prof, Path(out).with_suffix(".trace_r3.json"))


def _export(prof, trace: Path) -> None:
    """The profile as a gzipped chrome trace `trace`.gz (tests/bench/trace_summary.py reads it)."""
    import gzip

    prof.export_chrome_trace(str(trace))
    Path(f"{trace}.gz").write_bytes(gzip.compress(trace.read_bytes()))
    trace.unlink()


def _cprofile(tr, samples: list) -> None:
    """One r3 step under cProfile; rank 0 prints the functions with the most own host time
    (--cprofile: where the host's time per step goes, the GPU's launches included)."""
    import cProfile
    import io
    import pstats

    import torch

    with cProfile.Profile() as prof:
        tr.train_step(samples, "r3")
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    if torch.distributed.get_rank() == 0:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
        print(text.getvalue())


def _union_ms(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans in microseconds, as milliseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def _busy_line(prof, mode: str) -> str:
    """Where the step's wall time went on rank 0's GPU: busy with any kernel, with NCCL kernels
    only, with compute kernels only (unions of kernel intervals), against the profiled wall."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    gpu = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
           for e in events if e.device_type == DeviceType.CUDA]
    if not gpu:
        return f"== {mode}: no device events"
    wall = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
    busy = _union_ms([(a, b) for a, b, _ in gpu])
    nccl = _union_ms([(a, b) for a, b, n in gpu if n])
    comp = _union_ms([(a, b) for a, b, n in gpu if not n])
    return (f"== {mode}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms (compute {comp:.1f}, NCCL "
            f"{nccl:.1f}, both at once {comp + nccl - busy:.1f}), idle {wall - busy:.1f} ms")


def _optim_switches(args: argparse.Namespace) -> dict:
    """The fast path's optimizer switches that were given (older checkouts lack the fields)."""
    out: dict = {k: True for k in ("overlap_grad_reduce", "overlap_param_gather", "fused_adam")
                 if getattr(args, k)}
    if args.param_gather_dispatch != "forward":
        out["param_gather_dispatch"] = args.param_gather_dispatch
    return out


def _launch(args: argparse.Namespace, model_dir: str, tmp: Path, script: str = __file__,
            extra: tuple[str, ...] = ()) -> list[dict]:
    """One process of `script --rank-of MODEL_DIR OUT <this command's arguments> <extra>` per
    GPU; each writes its figures as JSON to OUT."""
    outs = [tmp / f"r{r}.json" for r in range(args.gpus)]
    try:
        run_ranks(lambda r: [str(Path(script).resolve()), "--rank-of", model_dir, str(outs[r]),
                             *sys.argv[1:], *extra], args.gpus, gpu=True, timeout=None,
                  threads=None)
    except RanksFailed as e:
        raise SystemExit(str(e)) from None
    return [json.loads(p.read_text()) for p in outs]


def _plan(args: argparse.Namespace, cfg: dict) -> float:
    from trainer.plan.layout import Arch, Layout
    from trainer.plan.memory import plan

    lay = Layout(world=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep, seq_len=args.seq_len,
                 distributed_optimizer=args.distributed_optimizer,
                 recompute="moe" if args.recompute_moe else "none", attention=args.attention,
                 micro_batch=args.micro_batch, chunked_logprobs=args.chunked_logprobs)
    return plan(Arch.from_hf_config(cfg), lay, gpu_gib=80, overhead_gib=0).total


def _gpu_gib() -> float:
    """Memory of GPU 0 from nvidia-smi (no CUDA context in the launcher); 80 without one."""
    import subprocess

    try:
        mib = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits", "-i", "0"], capture_output=True, text=True, timeout=60,
                             check=True).stdout.split()[0]
        return float(mib) / 1024
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return 80.0


def _pick_recompute(args: argparse.Namespace, cfg: dict, gpu_gib: float) -> str:
    """`r3flow plan`'s pick for this workload with recompute unset (issue 44: none when the
    estimate without it fits `gpu_gib` with the plan's 4 GiB overhead, else moe, else full) and
    its line. Sets args.recompute_moe to it when --[no-]recompute-moe was not given."""
    from trainer.plan.layout import Arch, Layout
    from trainer.plan.memory import choose_recompute, plan

    lay = Layout(world=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep, seq_len=args.seq_len,
                 distributed_optimizer=args.distributed_optimizer, recompute_set=False,
                 attention=args.attention, micro_batch=args.micro_batch,
                 chunked_logprobs=args.chunked_logprobs)
    arch = Arch.from_hf_config(cfg)
    pick, _ = choose_recompute(arch, lay, gpu_gib)
    line = plan(arch, lay, gpu_gib=gpu_gib).recompute
    if pick == "full" and args.recompute_moe is None:
        raise SystemExit(f"the plan picks full recompute ({line}); the bench runs MoE "
                         "recompute or none: give --recompute-moe to run it anyway")
    if args.recompute_moe is None:
        args.recompute_moe = pick == "moe"
    return f"plan for {gpu_gib:.1f} GiB: {line}"


def _smoke(args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args.small, args.gpus, args.ep, args.tp, args.pp = True, 1, 1, 1, 1
        args.layers, args.seq_len, args.samples, args.rounds = 2, 64, 1, 1
    return args


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """GPUs, layers and tokens per step: the workload options both trainer benches share."""
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--samples", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=1, help="data.micro_batch_size")


def parser() -> argparse.ArgumentParser:
    """The bench's command line (the launcher's and each rank's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--recompute-moe", action=argparse.BooleanOptionalAction, default=None,
                   help="model.recompute_moe (default: r3flow plan's pick for the GPU's memory: "
                   "none when the estimate without it fits)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--experts", choices=("sequential", "grouped"), default="sequential",
                   help="model.experts (grouped: the fast path's grouped GEMM)")
    p.add_argument("--attention", choices=("unfused", "sdpa"), default="unfused",
                   help="model.attention (sdpa: fused causal attention)")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="optim.overlap_grad_reduce")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="optim.overlap_param_gather (needs --overlap-grad-reduce and the "
                   "distributed optimizer)")
    p.add_argument("--param-gather-dispatch", choices=("forward", "step"), default="forward",
                   help="optim.param_gather_dispatch (with --overlap-param-gather)")
    p.add_argument("--fused-adam", action="store_true", help="optim.fused_adam")
    p.add_argument("--planned-dispatch", action="store_true",
                   help="model.planned_dispatch (replay-aware MoE dispatch: no per-layer host "
                   "sync for the all-to-all split sizes under r3/r2)")
    p.add_argument("--batch-first-logits", action=argparse.BooleanOptionalAction, default=None,
                   help="model.batch_first_logits (no copy of the logits for megatron's "
                   "[S, B, V] -> [B, S, V]; default: the field's default, auto)")
    p.add_argument("--skip-old-pass", choices=("auto", "on", "off"), default=None,
                   help="loss.skip_old_policy_pass (no old-policy forward when a batch takes "
                   "one update; default: the field's default, auto)")
    p.add_argument("--chunked-logprobs", action="store_true", help="loss.chunked_logprobs")
    p.add_argument("--logprob-kernel", choices=("auto", "torch", "triton"), default="auto",
                   help="loss.logprob_kernel (with --chunked-logprobs: torch = the chunked torch "
                   "loop, triton = trainer.losses.logprobs_triton; auto = triton on CUDA)")
    p.add_argument("--check-agreement", action=argparse.BooleanOptionalAction, default=False,
                   help="replay.check_agreement (the routing agreement check of r3/r2 passes)")
    p.add_argument("--profile", action="store_true", help="profile one off and one r3 step")
    p.add_argument("--profile-stack", action="store_true", help="--profile and a third step, "
                   "r3 with Python stacks (where each kernel was launched from)")
    p.add_argument("--cprofile", action="store_true", help="cProfile one r3 step (host time)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--small", action="store_true", help="tiny widths (CPU smoke)")
    p.add_argument("--out", default=str(REPO / "bench-results" / "megatron_parallel.json"))
    p.add_argument("--smoke", action="store_true", help="make test's run on the CPU: --small, "
                   "one rank, 2 layers, one 64-token sequence, one timed round")
    p.add_argument("--moe-permute", choices=("megatron", "gather"), default=None,
                   help="model.moe_permute (gather: trainer.megatron.gather_permute; default: "
                   "the field's default)")
    p.add_argument("--variants", default="",
                   help="NAME:ARGS;NAME:ARGS... - each variant's trainer (these arguments with "
                   "ARGS appended) built and timed in turn in the same rank processes, one "
                   "table and one JSON entry per variant (imports and the CUDA context paid "
                   "once)")
    return p


def main() -> None:
    p = parser()
    if sys.argv[1:2] == ["--rank-of"]:
        model_dir, out = sys.argv[2], sys.argv[3]
        base = sys.argv[4:]
        _rank(_smoke(p.parse_args(base)), model_dir, out, _variants(p, base))
        return
    args = _smoke(p.parse_args())
    cfg = _hf_config(args.layers, args.small)
    given = args.recompute_moe is not None
    pick_line = _pick_recompute(args, cfg, _gpu_gib())
    print(f"{pick_line}; run: recompute_moe {args.recompute_moe} "
          f"({'as given' if given else 'the pick'})")
    extra = () if given else ("--recompute-moe" if args.recompute_moe else "--no-recompute-moe",)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        ranks = _launch(args, d, Path(d), extra=extra)
    variants = _variants(p, sys.argv[1:] + list(extra))
    results = {name: _result(vargs, cfg, [r["variants"][name] for r in ranks], pick_line)
               for name, vargs in variants}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(
        results[""] if len(results) == 1 else {"variants": results}, indent=2))
    for (name, vargs), res in zip(variants, results.values(), strict=True):
        _print(name, vargs, res)


def _variants(p: argparse.ArgumentParser, base: list[str]) -> list[tuple[str, argparse.Namespace]]:
    """(name, arguments) of each --variants entry, or [("", the arguments)] without any."""
    import shlex

    spec = p.parse_args(base).variants
    if not spec:
        return [("", _smoke(p.parse_args(base)))]
    out = []
    for item in filter(None, (v.strip() for v in spec.split(";"))):
        name, _, extra = item.partition(":")
        if not name.isidentifier():
            raise SystemExit(f"--variants: {name!r} is not a name (letters, digits, _)")
        out.append((name, _smoke(p.parse_args(base + shlex.split(extra)))))
    return out


def _result(args: argparse.Namespace, cfg: dict, ranks: list[dict], pick_line: str) -> dict:
    """One variant's figures over its ranks: median step per mode, tokens/s, MFU, memory."""
    med = {m: statistics.median(max(r["times"][m][i] for r in ranks)
                                for i in range(args.rounds)) for m in MODES}
    tokens = args.samples * args.seq_len * args.gpus  # trained per step (every rank's share)
    fpt, dec = _flops_per_token(cfg, args.seq_len), _flops_per_token(cfg, args.seq_len, False)
    # forward + backward (3 x a forward's FLOPs) + the old-policy forward, unless it was skipped
    skipped = {m: any(r.get("skipped", {}).get(m, False) for r in ranks) for m in MODES}
    passes = {m: 3 if skipped[m] else 4 for m in MODES}
    res = {"config": vars(args), "step_seconds": med,
           "tokens_per_s_per_gpu": {m: tokens / med[m] / args.gpus for m in MODES},
           "old_pass_skipped": skipped,
           "mfu": {m: passes[m] * fpt * tokens / med[m] / args.gpus
                   / (args.peak_tflops * 1e12) for m in MODES},
           "mfu_decoder": {m: passes[m] * dec * tokens / med[m] / args.gpus
                           / (args.peak_tflops * 1e12) for m in MODES},
           "r3_over_off": med["r3"] / med["off"], "r2_over_off": med["r2"] / med["off"],
           "peak_gib_per_rank": [r["peak_bytes"] / 2**30 for r in ranks],
           "plan_gib_no_overhead": _plan(args, cfg) / 2**30, "recompute_plan": pick_line,
           "build_s": max(r.get("build_s", 0.0) for r in ranks)}
    try:
        import torch

        res["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    return res


def _print(name: str, args: argparse.Namespace, res: dict) -> None:
    skipped = [m for m in MODES if res["old_pass_skipped"][m]] or "none"
    print(f"{'== variant ' + name + ': ' if name else ''}experts {args.experts}, attention "
          f"{args.attention}, tp {args.tp} ep {args.ep}, "
          f"check_agreement {args.check_agreement}, optim {_optim_switches(args) or 'plain'}, "
          f"chunked_logprobs {args.chunked_logprobs} ({args.logprob_kernel}), micro-batch {args.micro_batch}, "
          f"samples {args.samples}, recompute_moe {args.recompute_moe}, planned_dispatch "
          f"{args.planned_dispatch}, batch_first_logits "
          f"{'default' if args.batch_first_logits is None else args.batch_first_logits}, "
          f"moe_permute {args.moe_permute or 'default'}, old pass skipped {skipped}")
    print(f"{'mode':5s} {'step s':>8s} {'tok/s/GPU':>10s} {'MFU':>6s} {'MFU dec':>7s}")
    for m in MODES:
        print(f"{m:5s} {res['step_seconds'][m]:8.3f} {res['tokens_per_s_per_gpu'][m]:10.0f} "
              f"{res['mfu'][m]:6.3f} {res['mfu_decoder'][m]:7.3f}")
    print(f"r3/off {res['r3_over_off']:.3f}  r2/off {res['r2_over_off']:.3f}  peak GiB per rank "
          f"{[round(x, 2) for x in res['peak_gib_per_rank']]}  plan (no overhead) "
          f"{res['plan_gib_no_overhead']:.2f} GiB  on {res.get('device')}")


if __name__ == "__main__":
    main()
