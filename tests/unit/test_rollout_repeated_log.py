"""RepeatedLog: a failure that repeats (only its numbers differ) is logged once, then counted."""

from __future__ import annotations

import logging

import pytest

from services.rollout.report import RepeatedLog


def test_repeats_are_counted_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    rep = RepeatedLog(logging.getLogger("test.repeated"))
    with caplog.at_level(logging.ERROR):
        for i in range(1000):
            rep.error(f"group w-g{i} (prompt {i}, epoch 0) failed: store refused")
        rep.error("a different failure")
        rep.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "group w-g0 (prompt 0, epoch 0) failed: store refused"
    assert "a different failure" in lines
    assert len(lines) <= 8, lines  # first, repeats 2/11/101, the other message, the flush
    assert lines[-1].startswith("1000 errors like: group w-gN (prompt N, epoch N)")
