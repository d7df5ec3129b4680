"""The `r3flow` console script: one entry point, one subcommand per process kind.

Each subcommand lives in a small module exposing `add_arguments(parser)`, `load(args)` (reads
and validates every input, starts and writes nothing) and `run(args) -> int`; those modules
import torch/vllm/megatron only inside `run`, so `r3flow --help` is instant. Every command
reports a user's mistake the same way (services/common/errors.py): one line
`r3flow <command>: ...`, exit 2; a bug keeps its traceback, exit 1.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

from services.common.cpu_features import request_amx_permission
from services.common.errors import (
    Parser,
    add_common_flags,
    argv_inputs,
    run_command,
    setup_logging,
)

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "store": ("services.store.cli", "serve the TrajectoryStore gRPC service over Redis"),
    "rollout": ("services.rollout.cli", "run a vLLM rollout worker that streams to the store"),
    "train": ("trainer.cli", "run the megatron-core GRPO/PPO trainer with routing replay"),
    "local": ("services.local.cli", "run the whole system on this machine"),
    "model": ("services.rollout.model_cli", "build local models (tiny MoE)"),
    "plan": ("trainer.plan.cli", "per-rank GPU memory of a training job; exit 1 if it does not fit"),
}


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The full CLI parser (also used by chart tests to parse rendered container commands);
    built once per process (parsing does not change it)."""
    parser = Parser(prog="r3flow", description=__doc__.splitlines()[0])
    add_common_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        add_common_flags(p)
        p.set_defaults(_module=module_name, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # named by the command's own parser: `r3flow local: unrecognized arguments: ...`
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.log_level)
    module = importlib.import_module(args._module)
    return run_command(args.command, lambda: _body(module, args), argv_inputs(args),
                       debug=args.log_level == "DEBUG")


def _body(module, args: argparse.Namespace) -> int:  # noqa: ANN001 (a subcommand module)
    if args.check:
        module.load(args)
        return 0
    # Every r3flow process may run torch bf16 CPU kernels that use AMX (no-op without AMX);
    # vLLM's own processes ask through the `vllm.general_plugins` entry point.
    request_amx_permission()
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
