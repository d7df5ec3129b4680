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


# Markdown links: `[text](target)` (images too); a target is a path relative to the page,
# optionally with `#anchor`, or an external URL (not checked: no network here).
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Reference-style links: `[text][label]` and, on a line of its own, `[label]: target`.
REF_DEF = re.compile(r"^\[([^\]]+)\]: +(\S+)", re.M)
REF_USE = re.compile(r"\]\[([^\]]+)\]")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (word characters, spaces and
    hyphens stay), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(page.read_text()):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
    return out


def _pages() -> list[Path]:
    return sorted({*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"),
                   *(ROOT / "trainer").rglob("*.md"), *(ROOT / "services").rglob("*.md"),
                   *(ROOT / "helm").rglob("*.md")})


def _broken_links(page: Path) -> list[str]:
    bad = []
    text = page.read_text()
    for target in [*LINK.findall(text), *(t for _, t in REF_DEF.findall(text))]:
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {path or page.name}")
    return bad


def test_slug_matches_githubs_anchors():
    assert _slug("Calls 5-7 (2026-11-27 15:49-16:17, commits `a2d586d`): EP4") == (
        "calls-5-7-2026-11-27-1549-1617-commits-a2d586d-ep4")
    assert _slug("Round 5: raw/push 0.89 / 0.88") == "round-5-rawpush-089--088"


def test_every_relative_link_in_the_docs_resolves():
    bad = {str(p.relative_to(ROOT)): b for p in _pages() if (b := _broken_links(p))}
    assert not bad, bad


def test_broken_link_and_anchor_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#two-words) [ok](#here) [x](a.md#three) [y](gone.md) [z](https://x.y)\n"
                    "# Here\n[ref]: a.md#four\n")
    assert _broken_links(page) == ["a.md#three: no heading with that anchor in a.md",
                                   "gone.md: no such file",
                                   "a.md#four: no heading with that anchor in a.md"]


def test_benchmarks_page_is_short_and_every_figure_links_to_its_notebook():
    """BENCHMARKS.md is the five-minute page (issue 45): at most 280 lines of at most 300
    characters (issue 56), each table row a headline figure linked (inline or by a reference
    label) to its section in docs/benchmarks/, every notebook linked."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 280, len(lines)
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 300]
    assert not long, f"lines over 300 characters (reflow them): {long}"
    rows = [line for i, line in enumerate(lines) if line.startswith("|")
            and not re.match(r"\|[-| ]+\|$", line)
            and not (i + 1 < len(lines) and re.match(r"\|[-| ]+\|$", lines[i + 1]))]
    assert len(rows) >= 13
    refs = dict(REF_DEF.findall(text))
    assert all(label in refs for r in rows for label in REF_USE.findall(r)), "undefined label"
    notebook = re.compile(r"docs/benchmarks/[\w.-]+\.md#[\w-]+$")
    unlinked = [r for r in rows if not re.search(r"\]\(docs/benchmarks/[\w.-]+\.md#[\w-]+\)", r)
                and not any(notebook.match(refs[label]) for label in REF_USE.findall(r))]
    assert not unlinked, unlinked
    for row in rows:  # the date and commit columns are filled
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[-1] and cells[-2], row
    notebooks = {p.name for p in (ROOT / "docs/benchmarks").glob("*.md")}
    linked = set(re.findall(r"(?:\(|\]: )docs/benchmarks/([\w.-]+\.md)#", text))
    assert notebooks == linked, notebooks ^ linked


def test_docs_index_lists_every_page():
    """docs/README.md indexes the docs: a page added to docs/ gets its line there."""
    index = ROOT / "docs/README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in LINK.findall(index.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"add a line for each to docs/README.md: {missing}"
