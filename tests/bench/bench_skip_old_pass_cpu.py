"""loss.skip_old_policy_pass on CPU (issue 55): step time with the old-policy pass and without.

Workload: a tiny Qwen3-MoE (4 layers, layer 0 dense, tests/integration/trainer_fixtures.TINY
widths), fp32, 1 gloo rank, r3 with the model's own natural routing; 16 samples of 5 prompt +
48 response tokens, micro-batch 2. Rounds alternate off / on (`--rounds` of each), each a fresh
trainer: one warm-up step, then `--steps` timed steps. Prints per round the median and minimum
step seconds and the median old-policy-pass and update seconds (the step's own metrics).
    PYTHONPATH=. python tests/bench/bench_skip_old_pass_cpu.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests/integration")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    from trainer_fixtures import TINY, natural_samples

    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    d = build_tiny_moe(tempfile.mkdtemp(), TinyMoeConfig(num_layers=4, first_k_dense=1, **TINY))
    samples = natural_samples(d, [0.0, 1.0] * 8, seed=3, lengths=[48] * 16)
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    for skip in ("off", "on") * args.rounds:
        tr = make_trainer(TrainerConfig(model_dir=str(d), data={"micro_batch_size": 2},
                                        loss={"skip_old_policy_pass": skip}))
        tr.train_step(copy.deepcopy(samples))  # warm-up
        ms = [tr.train_step(copy.deepcopy(samples)) for _ in range(args.steps)]
        step = [m["step_seconds"] for m in ms]
        print(f"{skip:3s} step median {statistics.median(step):.4f} s min {min(step):.4f} s, "
              f"old pass {statistics.median(m['old_pass_seconds'] for m in ms):.4f} s, "
              f"update {statistics.median(m['update_seconds'] for m in ms):.4f} s", flush=True)


if __name__ == "__main__":
    main()
