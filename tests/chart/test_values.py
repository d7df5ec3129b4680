"""values.yaml is documented and typed: bad values fail helm lint/template naming the key."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import CHART, run_helm

BAD_VALUES = {
    # name: (values file text, text the error must contain)
    "typo top-level": ("stor:\n  replicas: 2\n", "'stor'"),
    "typo nested": ("store:\n  service:\n    grpcPrt: 50051\n", "grpcPrt"),
    "string for integer": ('store:\n  replicas: "two"\n', "/store/replicas"),
    "string for port": ('rollout:\n  metricsPort: "9400x"\n', "/rollout/metricsPort"),
    "missing required": ("model:\n  path: null\n", "path"),
    "empty required": ('model:\n  path: ""\n', "/model/path"),
    "external redis without url": ("redis:\n  enabled: false\n", "/redis/external/url"),
    "bad enum": ("redis:\n  appendfsync: sometimes\n", "/redis/appendfsync"),
    "tls without its Secret": ("auth:\n  tls:\n    enabled: true\n", "/auth/tls/secretName"),
    "mutual TLS without TLS": ("auth:\n  tls:\n    mutual: true\n", "/auth/tls/enabled"),
    # issue 35: out of range, wrong kinds, unknown keys; and the config keys templates read
    "port out of range": ("store:\n  service:\n    grpcPort: 70000\n",
                          "/store/service/grpcPort"),
    "negative replicas": ("rollout:\n  replicas: -1\n", "/rollout/replicas"),
    "zero GPU memory": ("plan:\n  gpuMemoryGiB: 0\n", "/plan/gpuMemoryGiB"),
    "string for boolean": ('rollout:\n  enabled: "yes"\n', "/rollout/enabled"),
    "map for integer": ("redis:\n  port:\n    a: 1\n", "/redis/port"),
    "string for map": ("store:\n  resources: big\n", "/store/resources"),
    "list for config": ("trainer:\n  config: [1]\n", "/trainer/config"),
    "unknown key in a group": ("trainer:\n  workers:\n    gpu: 8\n", "'gpu'"),
    "engine not a map": ("rollout:\n  config:\n    engine: 3\n", "/rollout/config/engine"),
    "tensor parallel not a number": (
        "rollout:\n  config:\n    engine:\n      tensor_parallel_size: two\n",
        "/rollout/config/engine/tensor_parallel_size"),
    "trainer run not a map": ("trainer:\n  enabled: true\n  config:\n    run: x\n",
                              "/trainer/config/run"),
    "backlog not a number": ("store:\n  config:\n    max_backlog_tokens: lots\n",
                             "/store/config/max_backlog_tokens"),
}
# What a bad value must never produce: an error from inside a template or its YAML.
DEEP_ERRORS = ("error converting YAML", "wrong type for value", "executing \"r3flow/templates",
               "YAML parse error")


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
@pytest.mark.parametrize("command", ["lint", "template"])
def test_bad_values_fail_naming_the_key(helm, tmp_path, case, command):
    text, needle = BAD_VALUES[case]
    values = tmp_path / "bad.yaml"
    values.write_text(text)
    args = ["lint", "--strict"] if command == "lint" else ["template", "x"]
    proc = run_helm(helm, *args, str(CHART), "-f", str(values))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"{case}: helm {command} accepted it:\n{output}"
    assert needle in output, f"{case}: error does not name {needle!r}:\n{output}"
    deep = [e for e in DEEP_ERRORS if e in output]
    assert not deep, f"{case}: fails inside a template ({deep}), not naming the value:\n{output}"


def _documented_keys() -> set[str]:
    """Dotted keys that have a `# --` comment directly above them in values.yaml."""
    keys, stack, pending = set(), [], False
    for line in (CHART / "values.yaml").read_text().splitlines():
        if re.match(r"^\s*# -- ", line):
            pending = True
        elif m := re.match(r"^(\s*)([\"A-Za-z0-9_]+):", line):
            stack = stack[: len(m.group(1)) // 2] + [m.group(2)]
            if pending:
                keys.add(".".join(stack))
            pending = False
    return keys


def _leaf_keys(schema: dict, values: dict, prefix: str = "") -> set[str]:
    """Keys the schema spells out (free-form maps count as one leaf)."""
    out = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        sub = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and "properties" in sub:
            out |= _leaf_keys(sub, value, path + ".")
        else:
            out.add(path)
    return out


def test_every_value_is_documented_and_in_the_schema():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    leaves = _leaf_keys(schema, values)
    undocumented = leaves - _documented_keys()
    assert not undocumented, f"values without a `# --` comment: {sorted(undocumented)}"
    for path in leaves:
        node = schema
        for part in path.split("."):
            assert part in node.get("properties", {}), f"{path}: not in values.schema.json"
            node = node["properties"][part]
        assert "type" in node, f"{path}: schema gives no type"
