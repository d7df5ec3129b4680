"""Router margins bench (issue 57 item 4): bf16 engine-vs-trainer routing of a config's model,
warm-started with the margin recipe and without it, beside the published figures.

For the `r3flow local` config given (its `model:` sizes and seed, its warm start), each arm builds
and warm-starts the model as the run would (tests.support.router_margins.warm_model), samples
NUM_PROMPTS random prompts of PROMPT_LEN tokens + MAX_TOKENS at temperature 1 with vLLM in bf16
(routed experts on) and scores them with the megatron trainer in bf16. Arms: `recipe` (the
config's model.router_aux_loss_coef, or --aux) and `baseline` (router_aux_loss_coef 0: the
warm start without the load-balancing loss). Prints a table, writes <out>/<arm>.json.

  python tests/bench/bench_router_margins.py --config configs/local-gpu-h200.yaml --out DIR
  python tests/bench/bench_router_margins.py --smoke --out DIR   # router_margins.MINIATURE (CPU)
On a GPU, --arm one arm per process runs the two side by side (--util splits the memory).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from tests.support import router_margins as rm  # noqa: E402


def table(results: dict[str, dict]) -> None:
    """The arms beside the published figures moved to the arms' depth."""
    if not results:
        print("no arm finished")
        return
    layers = next(iter(results.values()))["moe_layers"]
    band = rm.published_band(layers)
    pub = rm.PUBLISHED
    print(f"{'':44s}" + "".join(f"{a:>12s}" for a in results) + f"{'published':>27s}")
    rows: list[tuple[str, str, str]] = [
        ("slot agreement, r3 pass (routing_agreement)", "slot_agreement", "n/a"),
        ("slot agreement, natural routing", "slot_agreement_natural",
         f"{band['slot_agreement_lo']:.3f}-{band['slot_agreement_hi']:.3f} (1-1.5 ids)"),
        ("router mismatch (token x layer sets)", "router_mismatch",
         f"{pub['router_mismatch']:.3f} ({band['router_mismatch_lo']:.3f}-"
         f"{band['router_mismatch_hi']:.3f})"),
        (f"tokens differing in >= 1 of {layers} layers", "token_mismatch",
         f"{band['token_mismatch_lo']:.3f}-{band['token_mismatch_hi']:.3f}"),
        ("the same at 48 layers", "token_mismatch_at_48_layers", f"{pub['token_mismatch']:.3f}"),
        ("differing routers per token", "routers_per_token",
         f"{pub['routers_per_token'] * layers / pub['moe_layers']:.2f} (x{layers}/48)"),
        ("ids per differing router", "ids_per_differing_router", "n/a")]
    for label, key, published in rows:
        print(f"{label:44s}" + "".join(f"{r[key]:12.4f}" for r in results.values())
              + f"{published:>27s}")


def main() -> int:
    from services.common.config import build_config, load_config
    from services.local.config import LocalConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="r3flow local config (default: the CPU local defaults)")
    p.add_argument("--out", default="bench-results/router-margins", help="<arm>.json here")
    p.add_argument("--work", help="the arms' models and rollouts (default: --out)")
    p.add_argument("--prompts", type=int, help="rollouts per arm (default: NUM_PROMPTS, 8)")
    p.add_argument("--table", action="store_true", help="only print the table of the arms' "
                   "JSON files under --out (arms run as separate processes)")
    p.add_argument("--arm", choices=("recipe", "baseline", "both"), default="both")
    p.add_argument("--aux", type=float, help="the recipe's router_aux_loss_coef (default: the "
                   "config's)")
    p.add_argument("--graphs", action="store_true", help="vLLM with CUDA graphs (GPU)")
    p.add_argument("--util", type=float, default=0.9, help="vLLM gpu_memory_utilization")
    p.add_argument("--seed", type=int, help="the run's seed (model init, data, warm start)")
    p.add_argument("--smoke", action="store_true", help="the GPU model in miniature "
                   "(tests.support.router_margins.MINIATURE) instead of --config")
    args = p.parse_args()
    cfg = (build_config(LocalConfig, rm.MINIATURE, source="MINIATURE") if args.smoke
           else load_config(LocalConfig, args.config) if args.config
           else build_config(LocalConfig, {}))
    if args.seed is not None:
        cfg = cfg.model_copy(update={"seed": args.seed})
    aux = args.aux if args.aux is not None else cfg.model.router_aux_loss_coef
    arms = {"recipe": aux, "baseline": 0.0}
    if args.arm != "both":
        arms = {args.arm: arms[args.arm]}
    out = Path(args.out)
    if args.table:
        table({a: json.loads((out / f"{a}.json").read_text()) for a in ("recipe", "baseline")
               if (out / f"{a}.json").exists()})
        return 0
    work, results = Path(args.work or args.out), {}
    for name, coef in arms.items():
        results[name] = rm.measure_arm(work / name, cfg, coef, eager=not args.graphs,
                                       util=args.util, prompts=args.prompts,
                                       threads=1 if args.smoke else None)
        rm.write_figures(out / f"{name}.json", results[name])
    table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
