"""Pod termination of a rollout worker: SIGTERM (to the worker process only, as Kubernetes
sends it) while it generates -> no new prompt, in-flight groups finish or are abandoned within
the grace period, a final summary, exit 0; the store has every group the summary calls sent."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from services.local.config import GrpoConfig, LocalConfig
from services.local.procs import wait_for
from services.local.run import LocalRun
from services.rollout.tiny_moe import TinyMoeConfig
from services.store.client import StoreClient

pytestmark = [pytest.mark.faults]


def test_sigterm_finishes_or_abandons_in_flight_groups_and_reports_them():
    runs = Path(tempfile.mkdtemp(prefix="r3flow-stop-"))
    grpo = GrpoConfig(group_size=4, groups_per_step=2, max_tokens=6)
    run = LocalRun(LocalConfig(runs_dir=str(runs), warm_start_steps=0, grpo=grpo,
                               model=TinyMoeConfig()))
    try:
        run.start_services(run.prepare())
        summary_path = run.summary_path("rollout-0")

        def sent_some() -> bool:
            s = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            return s.get("groups_ok", 0) >= 2 and s.get("groups_in_flight", 0) > 0

        wait_for(sent_some, 300, "rollout-0 to send groups", supervisor=run.sup)
        worker = run.child("rollout-0")
        run.stop_rollouts()
        assert worker.proc.returncode == 0
        s = json.loads(summary_path.read_text())
        with StoreClient(run.store_addr, timeout_s=10) as client:
            complete = client.stats().trajectories_complete
    finally:
        run.close()
    assert s["final"] and s["stopped_early"], s
    assert s["groups_in_flight"] == 0, s
    assert s["groups_started"] == s["groups_ok"] + s["groups_failed"] + s["groups_abandoned"], s
    assert s["trajectories_sent"] == 4 * s["groups_ok"] and s["trajectories_sent"] <= complete
    assert complete <= s["trajectories_sent"] + s["trajectories_abandoned"], (complete, s)
    shutil.rmtree(runs)
