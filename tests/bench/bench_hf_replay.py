"""HF/FSDP2 backend benchmark: step time with routing replay (r3) vs without (off), same run.

Workload: an HF Qwen3-MoE built locally (default: the tiny MoE of `r3flow local`, 3 layers with
layer 0 dense, 8 experts top-2; `--width` scales it up), the hf backend with packed micro-batches. The
rollout routing is the model's own natural routing (recorded once before timing), so both modes
run the same experts on the same tokens and the difference is the replay machinery itself: route
validation, the hook's gate-weight recompute and the agreement check. Rounds run off/r3, then
r3/off (ABBA), so drift, order effects and machine noise hit both; lr is tiny so routing stays
near natural.
replay_overhead_ratio = median r3 step / median off step (target <= 1.05); the median of the
per-round ratios is reported too. Writes bench-results/hf_replay.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _samples(tr, n: int, prompt_len: int, resp_len: int, seed: int) -> list:
    """n samples with the policy's own routing as the rollout routing (one no-grad pass)."""
    from trainer.samples.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = rng.integers(4, 90, prompt_len + resp_len)
        out.append(Sample(toks, prompt_len, np.zeros(resp_len, np.float32),
                          np.ones(resp_len, bool), float(rng.random()), f"g{i // 2}"))
    mbs = tr.backend.microbatches(out)
    tr.compute_logprobs(mbs, "r2")  # records natural routing per micro-batch
    for mb in mbs:
        rows_TLK = np.stack([r.cpu().numpy() for r in mb.replay_rows], 1)
        for s, off in zip(mb.samples, np.cumsum([0] + [x.tokens.size for x in mb.samples]),
                          strict=False):
            s.routing_TLK = rows_TLK[off:off + s.tokens.size - 1]
    return out


def run(model: Path, dtype: str, steps: int, n: int, prompt_len: int, resp_len: int,
        warmup: int = 2) -> dict:
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    tr = make_trainer(TrainerConfig.model_validate({
        "model_dir": str(model), "backend": "hf", "model": {"dtype": dtype}, "optim": {"lr": 1e-7},
        "data": {"micro_batch_size": 4}, "replay": {"agreement_floor": 0.5}}))
    samples = _samples(tr, n, prompt_len, resp_len, seed=0)
    times: dict[str, list[float]] = {"off": [], "r3": [], "off_cpu": [], "r3_cpu": []}
    agreement = []
    for i in range(warmup + steps):  # the order alternates (ABBA)
        for mode in (("off", "r3"), ("r3", "off"))[i % 2]:
            wall, cpu, m = _timed_step(tr, samples, mode)
            if i >= warmup:
                times[mode].append(wall)
                times[f"{mode}_cpu"].append(cpu)
            if mode == "r3":
                agreement.append(m["routing_agreement"])
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(r / o for r, o in zip(times["r3"], times["off"], strict=True))
    return {"dtype": dtype, "sharded": tr.backend.sharded, "device": str(tr.backend.device),
            "replay_overhead_ratio": med["r3"] / med["off"], "paired_ratio_median": paired,
            "cpu_seconds_ratio": med["r3_cpu"] / med["off_cpu"],
            "step_seconds_off_median": med["off"], "step_seconds_r3_median": med["r3"],
            "step_seconds_off": times["off"], "step_seconds_r3": times["r3"],
            "cpu_seconds_off": times["off_cpu"], "cpu_seconds_r3": times["r3_cpu"],
            "routing_agreement_min": min(agreement),
            "tokens_per_step": n * (prompt_len + resp_len)}


def _timed_step(tr, samples: list, mode: str) -> tuple[float, float, dict]:
    """(wall seconds, process CPU seconds, metrics) of one train_step (device synced)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    m = tr.train_step(samples, mode)
    sync()
    return time.perf_counter() - t0, time.process_time() - c0, m


def _build(tmp: Path, width: int) -> Path:
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    cfg = TinyMoeConfig.model_validate({
        "num_layers": 3, "first_k_dense": 1, "hidden_size": 128 * width,
        "moe_intermediate_size": 64 * width, "intermediate_size": 256 * width})
    return build_tiny_moe(tmp / "model", cfg)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed rounds (one off + one r3 step)")
    p.add_argument("--samples", type=int, default=8, help="samples per step")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=96)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--width", type=int, default=1, help="multiply hidden/FFN sizes")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--out", default=str(REPO / "bench-results/hf_replay.json"))
    p.add_argument("--smoke", action="store_true", help="make test's run: one timed round, "
                   "no warm-up, 2 short samples, fp32 (the keys, not the figures)")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.warmup, a.samples, a.prompt_len, a.response_len = 1, 0, 2, 8, 8
        a.dtypes = "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        model = _build(Path(tmp), a.width)
        runs = [run(model, dt, a.steps, a.samples, a.prompt_len, a.response_len, a.warmup)
                for dt in a.dtypes.split(",")]
    result = {"runs": runs, "width": a.width,
              "model": f"Qwen3-MoE 3 layers (1 dense), 8 experts top-2, hidden {128 * a.width}",
              "machine": _machine(), "smoke": a.smoke,
              "replay_overhead_ratio": max(r["replay_overhead_ratio"] for r in runs)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    _table(result)
    return 0


def _machine() -> str:
    import torch

    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return f"{torch.cuda.get_device_name(0)} ({cpu})" if torch.cuda.is_available() else cpu


def _table(res: dict) -> None:
    print(f"\n{res['model']}; {res['machine']}")
    print(f"{'device':<7} {'dtype':<6} {'fsdp2':<6} {'off s':>8} {'r3 s':>8} {'r3/off':>7} "
          f"{'paired':>7} {'cpu r3/off':>10} {'agree':>6}")
    for r in res["runs"]:
        print(f"{r['device']:<7} {r['dtype']:<6} {str(r['sharded']):<6} "
              f"{r['step_seconds_off_median']:>8.4f} {r['step_seconds_r3_median']:>8.4f} "
              f"{r['replay_overhead_ratio']:>7.3f} {r['paired_ratio_median']:>7.3f} "
              f"{r['cpu_seconds_ratio']:>10.3f} {r['routing_agreement_min']:>6.3f}")


if __name__ == "__main__":
    sys.exit(main())
