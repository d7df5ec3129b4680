"""`r3flow rollout --config FILE`: a vLLM rollout worker that streams GRPO groups to the store."""

from __future__ import annotations

import argparse
import logging

from services.common.errors import UserError, command_main

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="TOML/YAML/JSON file with RolloutConfig")
    parser.add_argument("--store", help="store gRPC address host:port (overrides `store`)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics and /health")
    parser.add_argument("--worker-id", help="unique worker name (overrides `worker_id`)")
    parser.add_argument("--model", help="HF model directory (overrides `engine.model`)")
    parser.add_argument("--summary-file", help="JSON summary of sent/failed/abandoned groups, "
                        "kept current while running and final at exit")
    parser.add_argument("--stop-grace-s", type=_seconds, default=30.0,
                        help="after SIGTERM, seconds in-flight groups may still finish")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config field by dotted key (repeatable)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def set_overrides(items: list[str]) -> dict[str, object]:
    """`--set KEY=VALUE` pairs as dotted-key overrides (UserError naming a malformed one)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    """Flags and --set KEY=VALUE pairs as dotted-key config overrides."""
    out = set_overrides(args.set)
    flags = {"store": args.store, "metrics_port": args.metrics_port,
             "worker_id": args.worker_id, "engine.model": args.model}
    out.update({k: v for k, v in flags.items() if v is not None})
    return out


def load(args: argparse.Namespace):
    """The RolloutConfig: every input, validated."""
    from services.common.config import load_config
    from services.rollout.config import RolloutConfig

    return load_config(RolloutConfig, args.config, overrides_from_args(args))


def run(args: argparse.Namespace) -> int:
    from services.rollout.app import serve
    from services.rollout.shutdown import hard_exit, run_bounded

    cfg = load(args)
    code = run_bounded(serve(cfg, summary_file=args.summary_file,
                             stop_grace_s=args.stop_grace_s))
    # The stop is complete (summary written, registration withdrawn, engine shut down); the
    # interpreter's own exit after it (atexit handlers, thread joins) took 14 s more under
    # load, with nothing left to save: leave now.
    log.info("rollout exits with code %d", code)
    hard_exit(code)
    return code  # not reached


def main(argv: list[str] | None = None) -> int:
    """`python -m services.rollout.cli ...` (same as `r3flow rollout ...`)."""
    return command_main("rollout", add_arguments, run, argv)


if __name__ == "__main__":  # engine processes re-import the main module: keep this guard
    raise SystemExit(main())
