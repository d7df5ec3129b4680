"""`r3flow model tiny-moe --out DIR`: build local models (no hub access);
`r3flow model fetch --uri URI --out DIR`: download one into a volume (services/rollout/model_fetch.py)."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from services.common import families
from services.common.errors import UserError, add_common_flags
from services.rollout.cli import set_overrides

log = logging.getLogger(__name__)
URI = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="MODEL")
    tiny = sub.add_parser("tiny-moe", help="write a small random-init Qwen3-MoE with a local tokenizer")
    tiny.add_argument("--out", required=True, help="output directory (HF format)")
    tiny.add_argument("--family", default=families.DEFAULT,
                      help=f"HF model_type to build: {', '.join(families.names())} "
                      f"(default {families.DEFAULT}; services/common/families/)")
    tiny.add_argument("--config", help="TOML/YAML file with TinyMoeConfig fields")
    tiny.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override one TinyMoeConfig field (repeatable), e.g. --set num_layers=3")
    fetch = sub.add_parser("fetch", help="download a model (hf://, s3://, gs://, file://) into "
                           "a directory once, shared by pods that start together")
    fetch.add_argument("--uri", required=True, help="hf://ORG/REPO[@REV] or an fsspec URI")
    fetch.add_argument("--out", required=True, help="model directory to create")
    for p in (tiny, fetch):
        add_common_flags(p, nested=True)


def _out_dir(out: str) -> Path:
    """--out, if it (or the nearest part of it that exists) is a directory to write into."""
    path = Path(out)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"--out {out}: {existing} exists and is not a directory")
    return path


def load(args: argparse.Namespace):
    """tiny-moe: the TinyMoeConfig (family known, --out not a file); fetch: the URI's form."""
    _out_dir(args.out)
    if args.model_command == "fetch":
        if not URI.fullmatch(args.uri):
            raise UserError(f"--uri {args.uri!r}: expected hf://ORG/REPO[@REV] or an fsspec "
                            "URI (s3://, gs://, file://...)")
        return None
    from services.common.config import load_config
    from services.common.tiny_moe import TinyMoeConfig

    if families.find(args.family) is None:
        raise UserError(f"--family: {args.family!r} is not one of {', '.join(families.names())}")
    return load_config(TinyMoeConfig, args.config, set_overrides(args.set))


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    if args.model_command == "fetch":
        from services.rollout.model_fetch import run_fetch

        return run_fetch(args.uri, args.out)
    out = families.build_family(args.out, args.family, cfg)
    log.info("tiny %s written to %s", args.family, out)
    print(out)
    return 0
