"""`python -m trainer ARGS` == `r3flow train ARGS` (the same module, without the other commands)."""

from __future__ import annotations

import sys

from services.common.errors import command_main
from trainer import cli


def main(argv: list[str] | None = None) -> int:
    return command_main("train", cli.add_arguments, cli.run, argv)


if __name__ == "__main__":
    sys.exit(main())
