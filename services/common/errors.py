"""One error path for every `r3flow` command: a user's mistake is one line, a bug a traceback.

A mistake the user can fix (a flag, a field of a config file, a file that is missing, unreadable
or does not parse, a manifest that is not a Kubernetes document, a store or Redis address that
does not answer at start) prints `r3flow <command>: <what is wrong, naming the flag, field or
file>`, at most one hint line, and exits 2 (argparse's code for a usage error). Anything else is
a bug: its traceback is printed and the exit code is 1. `--log-level debug` prints the traceback
of a user's mistake too. Code that finds such a mistake raises `UserError` (or `ConfigError`,
its subclass for config files); `run_command` is the only place that turns one into a line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

USER_ERROR_EXIT = 2
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class UserError(ValueError):
    """A mistake the user can fix; the message names the flag, field or file (one line).
    A ValueError, as most such mistakes are a bad value (callers that catch one still do)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def one_line(text: str) -> str:
    """`text` with its line breaks and runs of blanks folded into single spaces."""
    return " ".join(text.split())


def syntax_error(path: str | Path, exc: Exception) -> UserError:
    """A YAML/JSON/TOML syntax error of `path` as `PATH: line L, column C: problem`."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:  # yaml.MarkedYAMLError: 0-based line and column
        problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
        return UserError(f"{path}: line {mark.line + 1}, column {mark.column + 1}: "
                         f"{one_line(str(problem))}")
    if hasattr(exc, "lineno") and hasattr(exc, "colno"):  # json.JSONDecodeError, TOMLDecodeError
        msg = getattr(exc, "msg", str(exc)).split(" (at line")[0]
        return UserError(f"{path}: line {exc.lineno}, column {exc.colno}: {one_line(msg)}")
    return UserError(f"{path}: {one_line(str(exc))}")


def describe(exc: BaseException, inputs: Iterable[str] = ()) -> UserError | None:
    """The user's mistake `exc` stands for, or None when it is a bug.

    Besides `UserError`: pydantic's ValidationError (each bad field by its dotted name) and an
    OSError on a file the user named on the command line (`inputs`)."""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, OSError) and exc.filename is not None and _named(exc.filename, inputs):
        return UserError(f"{exc.filename}: {exc.strerror or type(exc).__name__}")
    errors = getattr(exc, "errors", None)
    if (type(exc).__name__ == "ValidationError" and type(exc).__module__.startswith("pydantic")
            and callable(errors)):  # matched by name: pydantic stays out of `r3flow --help`
        return UserError("; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: "
                                   f"{e['msg']}" for e in errors()))
    return None


def _named(filename: Any, inputs: Iterable[str]) -> bool:
    if not isinstance(filename, str | bytes | os.PathLike):  # e.g. a file descriptor
        return False
    given = {os.path.abspath(p) for p in inputs}
    return os.path.abspath(os.fsdecode(filename)) in given


def argv_inputs(args: argparse.Namespace) -> list[str]:
    """Every string value of the parsed command line: the files a user may have named."""
    out: list[str] = []
    for value in vars(args).values():
        values = value if isinstance(value, list) else [value]
        out += [v for v in values if isinstance(v, str) and v]
    return out


def run_command(name: str, body: Callable[[], int], inputs: Iterable[str] = (),
                debug: bool = False) -> int:
    """`body()`'s exit code; a user's mistake is reported on one line and gives 2, a bug raises
    on (its traceback and exit 1 come from Python), Ctrl-C gives 130."""
    try:
        return body()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        mistake = describe(exc, inputs)
        if mistake is None:
            raise
        if debug:
            traceback.print_exc()
        report(name, str(mistake), mistake.hint)
        return USER_ERROR_EXIT


def command_main(name: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """`python -m <module>` of one command (`r3flow <name>` without the others), same errors."""
    parser = Parser(prog=f"r3flow {name}")
    add_common_flags(parser, top=True)
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    return run_command(name, lambda: run(args), argv_inputs(args), args.log_level == "DEBUG")


def report(name: str, message: str, hint: str | None = None) -> None:
    """The user-error line (and hint) on stderr."""
    print(f"r3flow {name}: {one_line(message)}", file=sys.stderr)
    if hint:
        print(one_line(hint), file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error format (`PROG: argument --x: ...` + a --help hint)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {one_line(message)}", file=sys.stderr)
        print(f"see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT)


def add_common_flags(p: argparse.ArgumentParser, top: bool = False, nested: bool = False) -> None:
    """--log-level (before or after the command) and --check (after it; `nested`: on a
    sub-subcommand such as `model tiny-moe`, whose parent parser has them too)."""
    p.add_argument("--log-level", type=log_level, default="INFO" if top else argparse.SUPPRESS,
                   help="python logging level; debug also prints the traceback of a user's "
                   "mistake")
    if not top:
        p.add_argument("--check", action="store_true",
                       default=argparse.SUPPRESS if nested else False,
                       help="read and validate every flag and input file, then exit (0: valid, "
                       "2: the mistake on one line) without starting or writing anything")


def positive(kind: type, zero: bool = False) -> Callable[[str], Any]:
    """argparse type of a number flag: finite and > 0 (>= 0 with `zero`)."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (0 <= value if zero else 0 < value) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero else '>'} 0, got {text!r}")
        return value

    return parse


def log_level(text: str) -> str:
    """argparse type of --log-level: a logging level name."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
