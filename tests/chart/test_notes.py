"""NOTES.txt renders for every values file (helm template never renders it, install does)."""

from __future__ import annotations

import pytest
from conftest import VALUES_FILES, render_notes


@pytest.mark.parametrize("values", sorted(VALUES_FILES))
def test_notes_render(helm, tmp_path, values):
    extra = ["-f", str(VALUES_FILES[values])] if VALUES_FILES[values] else []
    notes = render_notes(helm, tmp_path, *extra)
    assert "r3flow-store:50051" in notes and "helm test r3flow -n r3flow" in notes
    # the chart's trainer on (else named runs)
    assert ("RayJob r3flow-trainer" in notes) == (values in ("production", "trainer"))
