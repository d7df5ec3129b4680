"""`r3flow model fetch` with a file:// URI (tests never download): once, marker, failures."""

from __future__ import annotations

from services import cli
from services.rollout import model_fetch


def test_fetch_copies_once_and_marks_completion(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    out = tmp_path / "models" / "m"
    assert cli.main(["model", "fetch", "--uri", f"file://{src}", "--out", str(out)]) == 0
    assert (out / "config.json").read_text() == "{}"
    assert (out / model_fetch.MARKER).read_text() == f"file://{src}"
    (src / "config.json").write_text("changed")
    model_fetch.fetch(f"file://{src}", out)  # completed: nothing copied again
    assert (out / "config.json").read_text() == "{}"


def test_failure_exits_nonzero_with_a_termination_message(tmp_path, monkeypatch):
    log = tmp_path / "termination-log"
    monkeypatch.setattr(model_fetch, "TERMINATION_LOG", log)
    rc = model_fetch.run_fetch(f"file://{tmp_path}/missing", str(tmp_path / "m"))
    assert rc == 1 and "missing" in log.read_text() and "failed" in log.read_text()
    assert not (tmp_path / "m").exists()
