"""The per-rank launcher of tests and benches (tests.support.ranks): each rank's place in the
world, the caller's PYTHONPATH kept behind the repository root (tests/unit/test_procenv.py
imports through it), a failing or hanging rank fails the launch, and no rank outlives it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.support.ranks import ROOT, RanksFailed, run_ranks, run_script_ranks

RANK_SCRIPT = """import json, os, sys
json.dump({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
           "path": os.environ["PYTHONPATH"], "arg": sys.argv[1]}, open(sys.argv[2], "w"))
"""


def test_each_rank_gets_its_place_and_the_extended_path(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/tmp/carried-wheels")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    got = run_script_ranks(script, tmp_path, ["model-dir"], world=3)
    assert [(r["rank"], r["world"], r["arg"]) for r in got] == [(i, 3, "model-dir")
                                                               for i in range(3)]
    assert all(r["path"].split(os.pathsep) == [str(ROOT), "/tmp/carried-wheels"] for r in got)
    assert json.loads((tmp_path / "rank2.json").read_text())["rank"] == 2


def test_a_failing_rank_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    with pytest.raises(RanksFailed, match=r"rank exit codes \[0, 3\]"):
        run_ranks(lambda r: [str(script)], 2)


def test_a_hanging_rank_is_killed_at_the_deadline(tmp_path: Path) -> None:
    # The child's sleep is the hang under test (a rank that never exits), not a wait: the
    # launcher must kill it at its 5 s deadline.
    script, pids = tmp_path / "hang.py", tmp_path / "pids"
    script.write_text("import os, sys, time\n"
                      f"open({str(pids)!r} + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
                      "time.sleep(0 if os.environ['RANK'] == '0' else 600)\n")
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"\[0, None\]"):
        run_ranks(lambda r: [str(script)], 2, timeout=5)
    assert time.monotonic() - start < 60
    assert not psutil.pid_exists(int((tmp_path / "pids1").read_text()))
