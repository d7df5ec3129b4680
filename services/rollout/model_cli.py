"""`r3flow model tiny-moe --out DIR`: build local models (no hub access);
`r3flow model fetch --uri URI --out DIR`: download one into a volume (services/rollout/model_fetch.py)."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="MODEL")
    tiny = sub.add_parser("tiny-moe", help="write a small random-init Qwen3-MoE with a local tokenizer")
    tiny.add_argument("--out", required=True, help="output directory (HF format)")
    tiny.add_argument("--family", default="qwen3_moe",
                      help="HF model_type to build: qwen3_moe (default), qwen2_moe, mixtral, "
                      "olmoe, deepseek_v3, glm4_moe, gpt_oss (services/rollout/families.py)")
    tiny.add_argument("--config", help="TOML/YAML file with TinyMoeConfig fields")
    tiny.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override one TinyMoeConfig field (repeatable), e.g. --set num_layers=3")
    fetch = sub.add_parser("fetch", help="download a model (hf://, s3://, gs://, file://) into "
                           "a directory once, shared by pods that start together")
    fetch.add_argument("--uri", required=True, help="hf://ORG/REPO[@REV] or an fsspec URI")
    fetch.add_argument("--out", required=True, help="model directory to create")


def run(args: argparse.Namespace) -> int:
    if args.model_command == "fetch":
        from services.rollout.model_fetch import run_fetch

        return run_fetch(args.uri, args.out)
    from services.common.config import load_config
    from services.rollout.families import build_family
    from services.rollout.tiny_moe import TinyMoeConfig

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = value
    cfg = load_config(TinyMoeConfig, args.config, overrides)
    out = build_family(args.out, args.family, cfg)
    log.info("tiny %s written to %s", args.family, out)
    print(out)
    return 0
