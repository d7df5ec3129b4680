"""Shared fixtures of the chart tests: the helm binary, rendered manifests, the k8s/ specs.

These tests run from scripts/chart_check.sh (`make chart-check`) after it installed helm into
.venv-tools; run alone they skip when helm is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "r3flow"
SCHEMAS = Path(os.environ.get("R3FLOW_SCHEMAS", ROOT.parent / "shared" / "schemas"))
VALUES_FILES = {"defaults": None, "trainer": CHART / "ci" / "trainer-values.yaml",
                "production": CHART / "ci" / "production-values.yaml",
                "minimal": CHART / "ci" / "minimal-values.yaml"}
API_VERSIONS = ["--api-versions", "ray.io/v1", "--api-versions", "monitoring.coreos.com/v1"]


def helm_path() -> Path:
    return Path(os.environ.get("R3FLOW_HELM", ROOT / ".venv-tools" / "bin" / "helm"))


@pytest.fixture(scope="session")
def helm() -> Path:
    path = helm_path()
    if not path.exists():
        pytest.skip(f"helm not installed at {path}; run `make chart-check`")
    return path


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


# NOTES.txt evaluated through `tpl` inside a ConfigMap of a throwaway copy of the chart.
_NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-probe
data:
  notes: {{ tpl (.Files.Get "NOTES.probe") . | quote }}
"""


def render_notes(helm: Path, tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install r3flow -n r3flow <args>` would print it."""
    chart = tmp_path / "r3flow"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "NOTES.probe")
    (chart / "templates" / "notes-probe.yaml").write_text(_NOTES_PROBE)
    proc = run_helm(helm, "template", "r3flow", str(chart), "-n", "r3flow", *args,
                    "--show-only", "templates/notes-probe.yaml")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["data"]["notes"]


@cache
def _render(helm: str, values: str | None) -> tuple[dict, ...]:
    args = ["template", "ci", str(CHART), *API_VERSIONS] + (["-f", values] if values else [])
    proc = run_helm(Path(helm), *args)
    assert proc.returncode == 0, proc.stderr
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


@pytest.fixture(scope="session")
def rendered(helm: Path):
    """values-file name -> rendered documents."""
    return {name: list(_render(str(helm), str(v) if v else None))
            for name, v in VALUES_FILES.items()}


@pytest.fixture(scope="session")
def k8s_specs() -> dict[str, list[dict]]:
    """k8s/*.yaml file name -> its documents."""
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
            for p in sorted((ROOT / "k8s").glob("*.yaml"))}


def find(docs: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and d["metadata"]["name"].endswith(name_suffix)]
