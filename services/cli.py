"""The `r3flow` console script: one entry point, one subcommand per process kind.

Each subcommand lives in a small module exposing `add_arguments(parser)` and `run(args) -> int`;
those modules import torch/vllm/megatron only inside `run`, so `r3flow --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "store": ("services.store.cli", "serve the TrajectoryStore gRPC service over Redis"),
    "rollout": ("services.rollout.cli", "run a vLLM rollout worker that streams to the store"),
    "train": ("trainer.cli", "run the megatron-core GRPO/PPO trainer with routing replay"),
    "local": ("services.local.cli", "run the whole system on this machine"),
    "model": ("services.rollout.model_cli", "build local models (tiny MoE)"),
    "plan": ("trainer.plan.cli", "per-rank GPU memory of a training job; exit 1 if it does not fit"),
}


def build_parser() -> argparse.ArgumentParser:
    """The full CLI parser (also used by chart tests to parse rendered container commands)."""
    parser = argparse.ArgumentParser(prog="r3flow", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(args._module)
    # Every r3flow process may run torch bf16 CPU kernels that use AMX (no-op without AMX);
    # vLLM's own processes ask through the `vllm.general_plugins` entry point.
    from services.common.cpu_features import request_amx_permission

    request_amx_permission()
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
