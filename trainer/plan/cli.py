"""`r3flow plan`: per-rank GPU memory of a training job; exit 1 when it does not fit.

Two ways in: `--manifest FILE` plans every RayJob of a k8s/ spec or a rendered chart (inputs
from the spec: trainer/plan/manifest.py), or `--config train.yaml --model M --gpu-memory-gib G
--seq-len S` plans one trainer config. Layout flags override what the config says (what-if).
"""

from __future__ import annotations

import argparse
from typing import Any

from services.common.errors import UserError, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("job")
    src.add_argument("--manifest", action="append", default=[],
                     help="k8s/ spec or `helm template` output; every RayJob in it is planned")
    src.add_argument("--config", help="trainer config file (TrainerConfig)")
    src.add_argument("--model", help="known name (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3, "
                     "tiny-moe), HF model dir or config.json of a registered family's model_type "
                     "(default with --config: its model_dir)")
    src.add_argument("--gpu-memory-gib", type=positive(float), help="memory of one GPU (with --config)")
    src.add_argument("--seq-len", type=positive(int), help="tokens per sequence (with --config)")
    src.add_argument("--group-size", type=positive(int), default=8,
                     help="samples per prompt, the rollouts' sampling.n (with --config; default "
                     "8, the chart's): replay keeps a step's micro-batches' routing on the GPU")
    what = p.add_argument_group("what-if overrides")
    for name in ("tp", "pp", "ep", "etp", "cp", "world", "micro-batch"):
        what.add_argument(f"--{name}", type=positive(int))
    what.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction)
    what.add_argument("--reference", action=argparse.BooleanOptionalAction,
                      help="reference model on/off (default: loss.kl_coef > 0)")
    what.add_argument("--recompute", choices=["none", "moe", "full"],
                      help="plan this recompute (default: the config's; when the config leaves "
                      "it unset, the plan names the lightest that fits)")
    what.add_argument("--vllm-share", type=positive(float, zero=True), default=0.0,
                      help="fraction of the GPU a colocated vLLM engine takes (default 0)")
    what.add_argument("--overhead-gib", type=positive(float, zero=True),
                      help="CUDA context + NCCL + fragmentation (default 4 on GPUs, 1 on CPUs)")
    p.add_argument("--check-expected", action="store_true",
                   help="exit 0 when every manifest job's verdict is its r3flow.io/plan-expect "
                        "annotation (make chart-check), instead of 0 only when all fit")


def _overrides(args: argparse.Namespace) -> dict:
    names = {"tp": "tp", "pp": "pp", "ep": "ep", "etp": "etp", "cp": "cp", "world": "world",
             "micro_batch": "micro_batch", "distributed_optimizer": "distributed_optimizer",
             "reference": "reference", "recompute": "recompute"}
    out = {field: getattr(args, a) for a, field in names.items() if getattr(args, a) is not None}
    if "recompute" in out:  # a recompute given here is set: the plan does not pick one
        out["recompute_set"] = True
    return out


def _config_plan(args: argparse.Namespace):
    from dataclasses import replace

    from services.common.config import load_config
    from trainer.config import TrainerConfig
    from trainer.plan.layout import Arch
    from trainer.plan.manifest import layout_from_trainer
    from trainer.plan.memory import plan
    from trainer.plan.models import load_model_config

    cfg = load_config(TrainerConfig, args.config)
    model_cfg = load_model_config(args.model or cfg.model_dir)
    arch = Arch.from_hf_config(model_cfg)
    # a GPU job (--gpu-memory-gib): `auto` switches decided as on CUDA
    lay = replace(layout_from_trainer(cfg, args.seq_len, True, model_cfg.get("model_type"),
                                      args.group_size), **_overrides(args))
    overhead = 4.0 if args.overhead_gib is None else args.overhead_gib
    return plan(arch, lay, args.gpu_memory_gib, overhead_gib=overhead, vllm_share=args.vllm_share)


def _check_flags(args: argparse.Namespace) -> None:
    if not args.manifest and not args.config:
        raise UserError("give --manifest FILE or --config FILE")
    if args.manifest and _overrides(args):
        raise UserError("what-if overrides go with --config, not --manifest")
    if args.config and (args.gpu_memory_gib is None or args.seq_len is None):
        raise UserError("--config needs --gpu-memory-gib and --seq-len")


def load(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(label, Plan, JobPlan or None) of --config and of every RayJob of every --manifest."""
    from trainer.plan.manifest import plan_manifest

    _check_flags(args)
    plans: list[tuple[str, Any, Any]] = []
    if args.config:
        plans.append((f"{args.config}:", _config_plan(args), None))
    for path in args.manifest:
        plans += [(f"{path} {job.where}:", job.plan, job)
                  for job in plan_manifest(path, args.overhead_gib)]
    return plans


def run(args: argparse.Namespace) -> int:
    from trainer.plan.manifest import plan_rollouts
    from trainer.plan.memory import format_plan
    from trainer.plan.store import plan_stores

    ok = True
    for path in args.manifest:  # rollout engines sized for the model (trainer/plan/rollout.py)
        for check in plan_rollouts(path):
            print(check.describe(f"{check.where}:"))
            ok &= check.ok
        for store in plan_stores(path):  # un-acked groups of a checkpoint interval (store.py)
            print(store.describe(f"{store.where}:"))
            ok &= store.ok
    for label, p, job in load(args):
        print(format_plan(p, label))
        if job is None:
            ok &= p.fits
            continue
        if job.expect:
            mark = "as expected" if job.as_expected else "NOT AS EXPECTED"
            print(f"  expected: {job.expect} ({mark}){': ' + job.reason if job.reason else ''}")
        ok &= job.as_expected if args.check_expected else job.plan.fits
    return 0 if ok else 1
