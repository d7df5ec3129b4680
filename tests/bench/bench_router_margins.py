"""Router margins bench (issue 57 item 4): bf16 engine-vs-trainer routing of a config's model,
warm-started with the margin recipe and without it, beside the published figures.

For the `r3flow local` config given (its `model:` sizes and seed, its warm start), each arm builds
and warm-starts the model as the run would (tests.support.router_margins.warm_model), samples
NUM_PROMPTS random prompts of PROMPT_LEN tokens + MAX_TOKENS at temperature 1 with vLLM in bf16
(routed experts on) and scores them with the megatron trainer in bf16. Arms: `recipe` (the
config's model.router_aux_loss_coef, or --aux) and `baseline` (router_aux_loss_coef 0: the
warm start without the load-balancing loss). Prints a table, writes <out>/<arm>.json.

  python tests/bench/bench_router_margins.py --config configs/local-gpu-h200.yaml --out DIR
  python tests/bench/bench_router_margins.py --smoke --out DIR   # the CPU local model, 2 arms
On a GPU, --arm one arm per process runs the two side by side (--util splits the memory).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from tests.support import router_margins as rm  # noqa: E402
from tests.support.vllm_sampling import (  # noqa: E402
    MAX_TOKENS,
    NUM_PROMPTS,
    PROMPT_LEN,
    load_rollouts,
    sample_in_child,
)

# The CPU smoke: the local model with the recipe at the coefficient the GPU config uses.
SMOKE_AUX = 0.1


def run_arm(root: Path, cfg, aux: float, eager: bool, util: float) -> dict:
    """Build + warm start, sample, score one arm; its figures and seconds per part."""
    t0 = time.perf_counter()
    model = rm.warm_model(root, cfg, aux)
    t1 = time.perf_counter()
    sample_in_child(model, root / "r.npz", num_prompts=NUM_PROMPTS, prompt_len=PROMPT_LEN,
                    max_tokens=MAX_TOKENS, max_model_len=256, enforce_eager=eager,
                    gpu_memory_utilization=util)
    t2 = time.perf_counter()
    figures = rm.routing_figures(model, load_rollouts(root / "r.npz"), PROMPT_LEN)
    return {**figures, "router_aux_loss_coef": aux, "engine": "eager" if eager else "graphs",
            "seconds": {"warm": t1 - t0, "sample": t2 - t1, "score": time.perf_counter() - t2}}


def table(results: dict[str, dict]) -> None:
    """The arms beside the published figures moved to the arms' depth."""
    layers = next(iter(results.values()))["moe_layers"]
    band = rm.published_band(layers)
    pub = rm.PUBLISHED
    print(f"{'':38s}" + "".join(f"{a:>12s}" for a in results) + f"{'published':>22s}")
    rows = [("slot agreement", "slot_agreement", "n/a"),
            ("router mismatch (token x layer sets)", "router_mismatch",
             f"{pub['router_mismatch']:.3f} ({band['router_mismatch_lo']:.3f}-"
             f"{band['router_mismatch_hi']:.3f})"),
            (f"tokens differing in >= 1 of {layers} layers", "token_mismatch",
             f"{band['token_mismatch_lo']:.3f}-{band['token_mismatch_hi']:.3f}"),
            ("the same at 48 layers", "token_mismatch_at_48_layers",
             f"{pub['token_mismatch']:.3f}"),
            ("differing routers per token", "routers_per_token",
             f"{pub['routers_per_token'] * layers / pub['moe_layers']:.2f} (x{layers}/48)")]
    for label, key, published in rows:
        print(f"{label:38s}" + "".join(f"{r[key]:12.4f}" for r in results.values())
              + f"{published:>22s}")


def main() -> int:
    from services.common.config import build_config, load_config
    from services.local.config import LocalConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="r3flow local config (default: the CPU local defaults)")
    p.add_argument("--out", default="bench-results/router-margins")
    p.add_argument("--arm", choices=("recipe", "baseline", "both"), default="both")
    p.add_argument("--aux", type=float, help="the recipe's router_aux_loss_coef (default: the "
                   f"config's; --smoke: {SMOKE_AUX})")
    p.add_argument("--graphs", action="store_true", help="vLLM with CUDA graphs (GPU)")
    p.add_argument("--util", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    p.add_argument("--smoke", action="store_true", help="the CPU local model, both arms")
    args = p.parse_args()
    cfg = load_config(LocalConfig, args.config) if args.config else build_config(LocalConfig, {})
    aux = args.aux if args.aux is not None else (
        SMOKE_AUX if args.smoke else cfg.model.router_aux_loss_coef)
    arms = {"recipe": aux, "baseline": 0.0}
    if args.arm != "both":
        arms = {args.arm: arms[args.arm]}
    out, results = Path(args.out), {}
    for name, coef in arms.items():
        results[name] = run_arm(out / name, cfg, coef, eager=not args.graphs, util=args.util)
        rm.write_figures(out / f"{name}.json", results[name])
    table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
