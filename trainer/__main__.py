"""`python -m trainer ARGS` == `r3flow train ARGS` (the same module, without the other commands)."""

from __future__ import annotations

import argparse
import logging
import sys

from trainer import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="r3flow train", description=cli.__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
