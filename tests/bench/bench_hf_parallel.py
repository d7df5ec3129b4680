"""HF/FSDP2 backend at Qwen3-30B-A3B widths on several GPUs: throughput, MFU, peak memory and
the step time of r3 against off, same run (issue 31; the megatron figures of the same widths come
from bench_megatron_parallel.py, whose model, samples and FLOP count this bench shares).

Model: Qwen3-30B-A3B's widths (hidden 2048, 128 experts top-8, expert FFN 768, 32 heads / 4 KV
heads, head dim 128, vocab 151,936) with `--layers` layers, random init written once as a
checkpoint (bf16, one safetensors file per layer, written by parallel threads) that every rank
reads its FSDP2 shards of (hf.meta_init). Each rank trains `--samples` sequences of `--seq-len`
tokens per step (micro-batch 1, packed); rollout routing is random distinct ids (r3 replays them). Modes alternate (off, r3, then the next round) after a
warm-up step each. One process per GPU (torch.distributed, NCCL; no Ray on the lent machines).
Writes bench-results/hf_parallel.json.
Run: python tests/bench/bench_hf_parallel.py --gpus 4 [--layers 8 --sharding full]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_megatron_parallel import (
    _flops_per_token,
    _hf_config,
    _launch,
    _samples,
    add_workload_args,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
MODES = ("off", "r3")


def _write_model(cfg: dict, model_dir: Path) -> None:
    """A random-init bf16 checkpoint of `cfg` in the names save_pretrained writes (one file per
    decoder layer, written by parallel threads; values drawn on the first GPU when there is
    one): the model is built on the meta device only for its names and shapes, so no process
    holds it (save_pretrained of the 8-layer model took minutes of device time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    conf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    shapes = {k: v.shape for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    model_dir.mkdir(parents=True)
    conf.save_pretrained(model_dir)
    files: dict[str, dict[str, torch.Size]] = {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        files.setdefault(f"model-{layer}.safetensors", {})[name] = shape
    index = {"metadata": {}, "weight_map": {n: f for f, ns in files.items() for n in ns}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: _write_file(model_dir / f, files[f]), files))


def _write_file(path: Path, shapes: dict) -> None:
    """Norm weights 1, everything else N(0, 0.02), bf16, as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name, shape in shapes.items():
        t = torch.ones(shape, dtype=torch.bfloat16, device=device) if "norm" in name else \
            torch.randn(shape, dtype=torch.bfloat16, device=device).mul_(0.02)
        out[name] = t.cpu()
    save_file(out, str(path), metadata={"format": "pt"})


def _trainer_config(args: argparse.Namespace, model_dir: str):
    from trainer.config import TrainerConfig

    hf = {"sharding": args.sharding, "shard_group_size": args.shard_group,
          "gradient_checkpointing": args.recompute, "sequence_parallel": args.sequence_parallel}
    return TrainerConfig.model_validate({
        "backend": "hf", "model_dir": model_dir, "hf": hf,
        "model": {"dtype": "bf16"}, "optim": {"lr": 1e-7},
        "data": {"micro_batch_size": 1, "pad_multiple": 128},
        "replay": {"check_agreement": args.check_agreement, "agreement_floor": 0.0},
        "run": {"launcher": "ray" if args.gpus > 1 else "local", "world_size": args.gpus}})


def _rank(args: argparse.Namespace, model_dir: str, out: str) -> None:
    import torch

    from trainer.backend import make_trainer

    t_load = time.perf_counter()
    tr = make_trainer(_trainer_config(args, model_dir))
    b = tr.backend
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    _say(rank, f"rank 0 built and loaded its shards in {time.perf_counter() - t_load:.1f} s")
    moe_layers, k, experts = len(b.moe_layers), b.top_k, b.num_experts
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):
        samples = _samples(args.samples, args.seq_len, moe_layers, k, experts, rank + 100 * r)
        for mode in MODES:
            sync()
            t0 = time.perf_counter()
            tr.train_step(samples, mode)
            sync()
            _say(rank, f"round {r} {mode}: {time.perf_counter() - t0:.3f} s")
            if r:
                times[mode].append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"times": times, "rank": rank, "sharded": b.sharded,
                                     "peak_bytes": torch.cuda.max_memory_allocated()
                                     if torch.cuda.is_available() else 0}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _say(rank: int, text: str) -> None:
    """Progress on rank 0's stdout (what a run cut short by its time limit still shows)."""
    if rank == 0:
        print(text, flush=True)


def summarise(args: argparse.Namespace, cfg: dict, ranks: list[dict]) -> dict:
    """Per mode: the median over rounds of the slowest rank's step, tokens/s per GPU, MFU."""
    tokens = args.samples * args.seq_len  # per rank per step
    # the update (3 x forward) and the old-policy forward, as bench_megatron_parallel counts
    flops = 4 * tokens * _flops_per_token(cfg, args.seq_len)
    out: dict = {"smoke": args.smoke, "gpus": args.gpus, "layers": args.layers, "seq_len": args.seq_len,
                 "samples_per_rank": args.samples, "sharding": args.sharding,
                 "shard_group": args.shard_group, "recompute": args.recompute,
                 "sequence_parallel": args.sequence_parallel,
                 "check_agreement": args.check_agreement,
                 "peak_gib_per_rank": [round(r["peak_bytes"] / 2**30, 2) for r in ranks]}
    for mode in MODES:
        step = statistics.median(max(r["times"][mode][i] for r in ranks)
                                 for i in range(args.rounds))
        out[mode] = {"step_seconds": round(step, 3),
                     "tokens_per_s_per_gpu": round(tokens / step),
                     "mfu": round(flops / step / (args.peak_tflops * 1e12), 4)}
    out["r3_over_off"] = round(out["r3"]["step_seconds"] / out["off"]["step_seconds"], 3)
    import torch

    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(p)
    p.add_argument("--sharding", choices=("full", "hybrid"), default="full")
    p.add_argument("--shard-group", type=int, default=0)
    p.add_argument("--recompute", action="store_true", help="hf.gradient_checkpointing")
    p.add_argument("--sequence-parallel", type=int, default=1, help="hf.sequence_parallel")
    p.add_argument("--check-agreement", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--small", action="store_true", help="CPU check: tiny widths")
    p.add_argument("--smoke", action="store_true", help="make test's run on the CPU: --small, "
                   "one rank, 2 layers, one 64-token sequence, one timed round")
    p.add_argument("--rank-of", nargs=2, metavar=("MODEL_DIR", "OUT"))
    p.add_argument("--out", default="bench-results/hf_parallel.json")
    args, _ = p.parse_known_args()
    if args.smoke:
        args.small, args.gpus, args.layers, args.seq_len, args.samples, args.rounds = (
            True, 1, 2, 64, 1, 1)
    if args.rank_of:
        _rank(args, *args.rank_of)
        return
    cfg = _hf_config(args.layers, small=args.small)
    with tempfile.TemporaryDirectory(prefix="hf_parallel_") as d:  # 11 GB at 8 layers
        tmp = Path(d)
        t0 = time.perf_counter()
        _write_model(cfg, tmp / "model")
        print(f"wrote the checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        res = summarise(args, cfg, _launch(args, str(tmp / "model"), tmp, __file__))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
