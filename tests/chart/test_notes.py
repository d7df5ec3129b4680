"""NOTES.txt renders for every values file (helm template never renders it, install does)."""

from __future__ import annotations

import shutil

import pytest
import yaml
from conftest import CHART, VALUES_FILES, run_helm

# NOTES.txt evaluated through `tpl` inside a ConfigMap of a throwaway copy of the chart.
_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-probe
data:
  notes: {{ tpl (.Files.Get "NOTES.probe") . | quote }}
"""


@pytest.mark.parametrize("values", sorted(VALUES_FILES))
def test_notes_render(helm, tmp_path, values):
    chart = tmp_path / "r3flow"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "NOTES.probe")
    (chart / "templates" / "notes-probe.yaml").write_text(_PROBE)
    extra = ["-f", str(VALUES_FILES[values])] if VALUES_FILES[values] else []
    proc = run_helm(helm, "template", "r3flow", str(chart), "-n", "r3flow", *extra,
                    "--show-only", "templates/notes-probe.yaml")
    assert proc.returncode == 0, proc.stderr
    notes = yaml.safe_load(proc.stdout)["data"]["notes"]
    assert "r3flow-store:50051" in notes and "helm test r3flow -n r3flow" in notes
    # the chart's trainer on (else named runs)
    assert ("RayJob r3flow-trainer" in notes) == (values in ("production", "trainer"))
