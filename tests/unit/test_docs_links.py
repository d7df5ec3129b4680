"""Every docs/ page that the code, the chart or the README points a user to exists (an alert's
description names docs/replay_guarantees.md; a dangling link there sends an on-call reader
nowhere)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = re.compile(r"docs/[A-Za-z0-9_./-]+\.md")


def _cited() -> dict[str, set[str]]:
    files = [ROOT / "README.md", *(ROOT / "services").rglob("*.py"),
             *(ROOT / "trainer").rglob("*.py"), *(ROOT / "helm").rglob("*.yaml")]
    out: dict[str, set[str]] = {}
    for f in files:
        for doc in DOC.findall(f.read_text(errors="replace")):
            out.setdefault(doc, set()).add(str(f.relative_to(ROOT)))
    return out


def test_every_cited_docs_page_exists():
    cited = _cited()
    assert "docs/replay_guarantees.md" in cited  # the quarantine alert's runbook
    missing = {d: sorted(by) for d, by in cited.items() if not (ROOT / d).is_file()}
    assert not missing, missing


def test_replay_guarantees_covers_every_partial_rollout_policy():
    from typing import get_args

    from services.rollout.config import RolloutConfig

    text = (ROOT / "docs/replay_guarantees.md").read_text()
    ann = RolloutConfig.model_fields["partial_rollout_policy"].annotation
    for policy in (*get_args(ann), "final"):
        assert f"| `{policy}`" in text, policy
