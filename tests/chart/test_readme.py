"""The chart README's parameter table is generated from values.yaml's `# --` comments
(scripts/chart_readme.py) and current: every documented value is in it, with its default."""

from __future__ import annotations

import importlib.util

import yaml
from conftest import CHART, ROOT

_spec = importlib.util.spec_from_file_location("chart_readme", ROOT / "scripts" / "chart_readme.py")
assert _spec and _spec.loader
chart_readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chart_readme)


def test_readme_table_is_current():
    readme = (CHART / "README.md").read_text()
    values = (CHART / "values.yaml").read_text()
    assert readme == chart_readme.render(readme, values), (
        "helm/r3flow/README.md is stale: run python scripts/chart_readme.py")


def test_every_documented_value_has_a_row():
    readme = (CHART / "README.md").read_text()
    keys = [k for k, _ in chart_readme.documented((CHART / "values.yaml").read_text())]
    assert len(keys) > 100
    for key in keys:
        assert f"| `{key}` |" in readme, key


def test_comment_blocks_become_rows():
    text = """
# A section note (not a `# --` block): documents nothing.

top:
  # -- First line,
  # continued.
  a: 1
  # -- Pipes | are escaped.
  b: {x: [1, 2]}
  undocumented: 3
"""
    assert chart_readme.documented(text) == [("top.a", "First line, continued."),
                                             ("top.b", "Pipes | are escaped.")]
    rows = chart_readme.table(text).splitlines()[2:]
    assert rows == ['| `top.a` | int | `1` | First line, continued. |',
                    '| `top.b` | object | `{"x": [1, 2]}` | Pipes \\| are escaped. |']
    assert yaml.safe_load(text)["top"]["undocumented"] == 3
