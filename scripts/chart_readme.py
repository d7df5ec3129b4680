"""Generate the parameter table of helm/r3flow/README.md from values.yaml's `# --` comments.

Every value's documentation lives once, above the value in values.yaml (helm-docs style: a
comment block that starts with `# --`, continued by plain `#` lines); this script turns those
blocks into the README's table, between its `<!-- parameters:start -->` and
`<!-- parameters:end -->` markers. tests/chart/test_readme.py checks the committed README is
current, so a value added without regenerating fails `make chart-check`.

    python scripts/chart_readme.py          # rewrite the table
    python scripts/chart_readme.py --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[1] / "helm" / "r3flow"
START, END = "<!-- parameters:start -->", "<!-- parameters:end -->"
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_\"]+):")
_DOC_START = re.compile(r"^\s*# -- ?(.*)$")
_DOC_MORE = re.compile(r"^\s*#(?! --) ?(.*)$")


def documented(values_text: str) -> list[tuple[str, str]]:
    """(dotted key, description) of every value with a `# --` block, in file order."""
    out: list[tuple[str, str]] = []
    stack: list[str] = []
    doc: list[str] | None = None
    for line in values_text.splitlines():
        if m := _DOC_START.match(line):
            doc = [m.group(1)]
        elif doc is not None and (m := _DOC_MORE.match(line)):
            doc.append(m.group(1))
        elif m := _KEY.match(line):
            stack = stack[: len(m.group(1)) // 2] + [m.group(2).strip('"')]
            if doc is not None:
                out.append((".".join(stack), " ".join(x.strip() for x in doc).strip()))
            doc = None
        elif not line.strip():
            doc = None  # a blank line ends a comment that documents nothing (a section note)
    return out


def _lookup(values: dict, dotted: str) -> object:
    node: object = values
    for part in dotted.split("."):
        assert isinstance(node, dict), dotted
        node = node[part]
    return node


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(value: object) -> str:
    return {dict: "object", list: "list", bool: "bool", int: "int", float: "float",
            str: "string", type(None): "null"}[type(value)]


def table(values_text: str) -> str:
    """The Markdown parameter table."""
    values = yaml.safe_load(values_text)
    rows = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for key, desc in documented(values_text):
        value = _lookup(values, key)
        default = json.dumps(value, separators=(", ", ": "))
        rows.append(f"| `{key}` | {_type(value)} | `{_cell(default)}` | {_cell(desc)} |")
    return "\n".join(rows) + "\n"


def render(readme_text: str, values_text: str) -> str:
    """`readme_text` with the table between the markers replaced by the current one."""
    head, sep, rest = readme_text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README: markers {START} ... {END} not found")
    return f"{head}{START}\n{table(values_text)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)
    readme = CHART / "README.md"
    want = render(readme.read_text(), (CHART / "values.yaml").read_text())
    if args.check:
        if readme.read_text() != want:
            print(f"{readme} is stale: run python scripts/chart_readme.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(want)
    print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
