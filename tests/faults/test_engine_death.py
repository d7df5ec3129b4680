"""A rollout worker's vLLM engine dies mid-run (SIGKILL of the engine's worker process, as an
OOM kill would do on a GPU pod): the worker stops taking prompts and exits non-zero within
30 s with a short log; `r3flow local` names the child that died, stops the others by pid,
accounts for every trajectory and exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from services.common.tiny_moe import TinyMoeConfig
from services.local.config import LocalConfig
from services.local.procs import wait_for

pytestmark = [pytest.mark.faults]

ROLLOUT_EXIT_S = 30.0
MAX_LOG_BYTES = 1 << 20


def _config(runs: Path) -> Path:
    cfg = LocalConfig(runs_dir=str(runs), workers=1, warm_start_steps=0, timeout_s=900,
                      model=TinyMoeConfig(), store={"max_policy_lag": 2},
                      rollout={"sampling": {"n": 4, "max_tokens": 6}},
                      trainer={"run": {"steps": 100_000, "launcher": "local"},
                               "data": {"groups_per_step": 2, "lease_seconds": 20},
                               "replay": {"compare_off": False},
                               "weight_sync": {"timeout_s": 10}})
    path = runs / "local.json"
    path.write_text(cfg.model_dump_json())
    return path


def _rollout_summary(runs: Path) -> tuple[Path | None, dict]:
    found = sorted(runs.glob("local-*/rollout/rollout-0.summary.json"))
    if not found:
        return None, {}
    try:
        return found[0], json.loads(found[0].read_text())
    except (OSError, ValueError):
        return found[0], {}


def test_killed_engine_worker_fails_the_rollout_and_the_local_run_fast():
    runs = Path(tempfile.mkdtemp(prefix="r3flow-engine-death-"))
    out = (runs / "local.out").open("w")
    local = subprocess.Popen([sys.executable, "-m", "services.cli", "local", "--config",
                              str(_config(runs))], stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        def generating() -> bool:
            s = _rollout_summary(runs)[1]
            return s.get("groups_ok", 0) >= 2 and s.get("groups_in_flight", 0) > 0
        wait_for(generating, 600, "rollout-0 to generate groups")
        summary_path, progress = _rollout_summary(runs)
        assert summary_path is not None
        victim = progress["engine_pids"]["worker"][0]
        assert psutil.Process(victim).ppid() in progress["engine_pids"]["engine_core"]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        rollout = psutil.Process(progress["pid"])
        wait_for(lambda: not rollout.is_running() or rollout.status() == psutil.STATUS_ZOMBIE,
                 ROLLOUT_EXIT_S + 30, "rollout-0 to exit")
        rollout_exit_s = time.monotonic() - killed_at
        rc = local.wait(timeout=300)
    finally:
        if local.poll() is None:
            os.killpg(local.pid, signal.SIGKILL)  # our own child's session, by pid
            local.wait()
        out.close()
    text = (runs / "local.out").read_text()
    run_dir = summary_path.parent.parent
    log_bytes = (run_dir / "logs" / "rollout-0.log").stat().st_size
    final = json.loads(summary_path.read_text())
    run_summary = json.loads((run_dir / "summary.json").read_text())
    print(f"rollout exit {rollout_exit_s:.1f}s after the kill, log {log_bytes} B, "
          f"local rc {rc}, trajectories {run_summary['trajectories']}")

    assert rollout_exit_s <= ROLLOUT_EXIT_S, rollout_exit_s
    assert log_bytes < MAX_LOG_BYTES
    assert rc != 0 and "rollout-0 exited with code 3" in text, text[-3000:]
    assert f"engine dead: vLLM process gone: worker pid {victim}" in text, text[-3000:]
    assert final["final"] and "engine dead" in final["fatal"], final
    assert final["groups_in_flight"] == 0 and final["groups_abandoned"] >= 1, final
    # No new group after the engine died: at most the groups that were in flight then (the
    # worker holds two groups per engine slot; 16 requests / groups of 4 -> 8 slots).
    assert final["groups_abandoned"] <= 8, final
    assert run_summary["failure"]["child"] == "rollout-0"
    assert run_summary["failure"]["exit_code"] == 3
    assert "engine dead" in run_summary["failure"]["cause"]
    acct = run_summary["trajectories"]
    assert acct["balanced"], acct
    assert acct["produced"] == (acct["trained"] + sum(acct["dropped"].values())
                                + acct["unused_at_end"] + acct["leased_at_stop"]
                                + acct["in_incomplete_groups"]), acct
