"""Validate Grafana dashboard JSON against the Grafana 11.6 schemas (grafana-foundation-sdk).

usage: dashboard_validate.py --schemas DIR  FILE_OR_DIR...

The dashboard schema leaves panel options, field config and query targets open (they belong to
plugins), so those parts are checked against the panel plugin's schema (e.g. timeseries) and the
Prometheus query schema as well. An empty directory is an error: a chart that renders no
dashboards while dashboards are expected should not pass silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jsonschema import Draft7Validator


def _definition(schema: dict, name: str) -> Draft7Validator:
    return Draft7Validator({"$ref": f"#/definitions/{name}",
                            "definitions": schema["definitions"]})


class DashboardSchemas:
    """Validators for the dashboard and for the plugin-owned parts of its panels."""

    def __init__(self, schema_dir: Path) -> None:
        load = lambda name: json.loads((schema_dir / "jsonschema" / name).read_text())  # noqa: E731
        self.dashboard = Draft7Validator(load("dashboard.jsonschema.json"))
        self.query = _definition(load("prometheus.jsonschema.json"), "dataquery")
        self._plugins = {}
        for plugin in ("timeseries", "stat"):
            schema = load(f"{plugin}.jsonschema.json")
            self._plugins[plugin] = (_definition(schema, "Options"),
                                     _definition(schema, "FieldConfig"))

    def errors(self, dash: dict) -> list[str]:
        out = [_fmt("", e) for e in self.dashboard.iter_errors(dash)]
        for i, panel in enumerate(dash.get("panels", [])):
            where = f"panels.{i}({panel.get('title')})"
            if panel.get("type") not in self._plugins:
                out.append(f"{where}: no plugin schema checked for type {panel.get('type')!r}")
                continue
            options, field_config = self._plugins[panel["type"]]
            out += [_fmt(f"{where}.options", e) for e in options.iter_errors(panel["options"])]
            custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
            out += [_fmt(f"{where}.custom", e) for e in field_config.iter_errors(custom)]
            for j, target in enumerate(panel.get("targets", [])):
                out += [_fmt(f"{where}.targets.{j}", e) for e in self.query.iter_errors(target)]
        return out


def _fmt(prefix: str, err: object) -> str:
    path = ".".join(map(str, err.absolute_path))  # type: ignore[attr-defined]
    return f"{prefix}{'.' if prefix and path else ''}{path or ''}: {err.message[:300]}"  # type: ignore[attr-defined]


def dashboard_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", required=True, type=Path)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    schemas = DashboardSchemas(args.schemas)
    files = dashboard_files(args.paths)
    if not files:
        print(f"ERROR no dashboard JSON under {' '.join(args.paths)}")
        return 1
    failed = 0
    for f in files:
        errors = schemas.errors(json.loads(f.read_text()))
        for line in errors:
            print(f"ERROR {f.name}: {line}")
        print(f"{'FAIL' if errors else 'OK  '} {f.name}")
        failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
