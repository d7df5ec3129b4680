"""Pull the PrometheusRule groups or the Grafana dashboards out of rendered chart YAML.

usage: extract.py rules RENDERED.yaml OUT.yaml      (empty file when no PrometheusRule)
       extract.py dashboards RENDERED.yaml OUT_DIR  (one .json per dashboard ConfigMap key)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def rendered_docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def extract_rules(docs: list[dict], out: Path) -> None:
    groups = [g for d in docs if d.get("kind") == "PrometheusRule" for g in d["spec"]["groups"]]
    out.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False) if groups else "")


def extract_dashboards(docs: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for d in docs:
        labels = d.get("metadata", {}).get("labels") or {}
        if d.get("kind") == "ConfigMap" and labels.get("grafana_dashboard") == "1":
            for key, text in d["data"].items():
                (out / key).write_text(text)


def main(argv: list[str]) -> int:
    what, rendered, out = argv
    docs = rendered_docs(rendered)
    {"rules": extract_rules, "dashboards": extract_dashboards}[what](docs, Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
