"""Spawned ranks and scripts keep the parent's PYTHONPATH (issue 43: the GPU runs put
megatron-core on PYTHONPATH, /tmp/pylib, and tests/gpu/test_trainer_param_gather_gpu.py's rank
processes, given `PYTHONPATH=<repo>` alone, failed with ModuleNotFoundError: megatron)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.common.procenv import pythonpath

ROOT = Path(__file__).resolve().parents[2]
# A pod of tests/cluster gets the environment its spec gives it, as a container would: the
# host's PYTHONPATH must not leak in (the checkout under test is set explicitly).
HERMETIC = {"tests/cluster/cluster.py"}


def test_pythonpath_puts_the_checkout_first_and_keeps_every_parent_entry():
    env = {"PYTHONPATH": os.pathsep.join(["/tmp/pylib", "", "/opt/x", "/tmp/pylib"])}
    assert pythonpath("/repo", env=env) == os.pathsep.join(["/repo", "/tmp/pylib", "/opt/x"])
    assert pythonpath(Path("/repo"), "/repo/tests", env={}) == os.pathsep.join(
        ["/repo", "/repo/tests"])
    assert pythonpath("/repo", env={"PYTHONPATH": "/repo"}) == "/repo"  # no duplicate


def test_spawned_ranks_import_a_module_only_the_parents_pythonpath_has(tmp_path, monkeypatch):
    """The shared rank launcher (tests.support.ranks, as the megatron rank tests and benches use
    it) on 2 ranks: each imports a module from a folder that is only on this process's
    PYTHONPATH, the way /tmp/pylib holds megatron on the GPU machine."""
    from tests.support.ranks import run_script_ranks

    pylib = tmp_path / "pylib"
    pylib.mkdir()
    (pylib / "r3flow_pylib_marker.py").write_text("WHERE = __file__\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pylib), os.environ.get(
        "PYTHONPATH", "")]))
    script = tmp_path / "rank.py"
    script.write_text("import json, os, sys\nimport r3flow_pylib_marker as m\n"
                      "json.dump({'rank': os.environ['RANK'], 'where': m.WHERE},"
                      " open(sys.argv[2], 'w'))\n")
    got = run_script_ranks(str(script), tmp_path, ["-"], world=2, timeout=60)
    assert [g["rank"] for g in got] == ["0", "1"]
    assert all(Path(g["where"]).parent == pylib for g in got)


def test_no_spawn_helper_replaces_pythonpath():
    """Every place that sets a child's PYTHONPATH builds it from the parent's (pythonpath(),
    or os.environ's own value): a bare `"PYTHONPATH": str(REPO)` is what broke the GPU run."""
    key = re.compile(r"""["']PYTHONPATH["']\s*:""")
    bad = []
    for path in sorted(p for d in ("services", "trainer", "tests", "scripts")
                       for p in (ROOT / d).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in HERMETIC or rel == "tests/unit/test_procenv.py":
            continue
        text = path.read_text()
        for m in key.finditer(text):
            value = text[m.end():m.end() + 200]
            if "pythonpath(" not in value and "environ.get(" not in value:
                bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not bad, f"child PYTHONPATH replaced, not extended (use pythonpath()): {bad}"
