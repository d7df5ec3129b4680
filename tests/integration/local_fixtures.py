"""One `r3flow local` run shared by test_local_run.py and test_local_alerts.py (the session
fixture `local_run_dir` in conftest.py), so `make test` boots the local topology for them once.

The run carries an injected ppo_kl spike: a step hook (tests/support/lr_spike.py, named in the
run config's `trainer.hooks`; trainer.hooks) runs the update of the first step SPIKE_AFTER_S seconds
into the run at a multiplied learning rate, so the next step's batch, sampled by the policy
before the jump, sits far from the trainer's policy.
That step is the last one (the hook ends the run there, through the loop's normal end; picking
the step by time, not by count, keeps the low ppo_kl long enough however fast the machine steps,
and no longer), and the trainer keeps serving its /metrics after it, so Prometheus sees the spike
held for longer than the rule's `for` (test_local_alerts.py says why it must). The hold ends on
the event the tests need: the run's `stop_on_alert` stops the trainer once Prometheus has
evaluated the alert as firing twice (~65 s after the spike); `metrics_linger_s` (HOLD_S) only
bounds it, for a run whose alert never fires.
Every step before the spike is an ordinary GRPO step of the tests' small MoE (test_local_run.py
checks them all).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Long enough that the low ppo_kl of the steps before the spike outlasts the rule's `for` with
# room to spare (a fixed 160 steps took 98 s on a quiet CI box and 340 s on a busy one).
SPIKE_AFTER_S = 80
MAX_STEPS = 1000  # an upper bound the timed spike ends the run well before
FACTOR = 40.0  # x the lr below: the spike lr (0.02) well above the steps before it
FOR_S = 60  # the chart rule's `for`
HOLD_S = 100  # trainer metrics_linger_s: the most the last step's ppo_kl is held (past FOR_S)
ALERT = "R3flowPpoKlSpike"
WARM_START_STEPS = 5


def need_prometheus() -> None:
    """Skip without a `prometheus` binary on the PATH; under CI (make test installs it) fail."""
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not on the PATH under CI (scripts/install_prometheus.sh)")
        pytest.skip("no prometheus binary on the PATH")


def spike_run(runs: Path, cfg_dir: Path) -> Path:
    """The `r3flow local` run (config file + flags, as a user starts one); its run folder."""
    cfg = cfg_dir / "spike.json"
    # the tests' small MoE (TinyMoeConfig defaults), not the run's 64-expert model, at half the
    # lr it was tuned with: at 1e-3 the policy's drift over ~65 quick steps raised the ppo_kl
    # of the last low steps so far (p75 0.031) that the spike (0.136) was under 5x the
    # Prometheus median once its own held samples joined it, and the alert did not fire
    cfg.write_text(json.dumps({
        # agreement floor 0: measured, not enforced. The step after the spike trains on a batch
        # the policy before the jump sampled, and its replayed routing can read below 0.5 on a
        # whole layer against the jumped router (0.482 once in 10 reruns under load), which
        # stops the run as a misaligned layer map before the alert can fire; the agreement of
        # the steps before it is still checked (test_local_run.test_step_log_and_report)
        "trainer": {"data": {"groups_per_step": 8}, "optim": {"lr": 5e-4},
                    "replay": {"agreement_floor": 0.0}, "run": {"metrics_linger_s": HOLD_S},
                    "hooks": [{"path": "tests.support.lr_spike:TimedLrSpike",
                               "options": {"after_s": SPIKE_AFTER_S, "factor": FACTOR}}]},
        "model": {}, "stop_on_alert": ALERT}))
    cmd = [sys.executable, "-m", "services.cli", "local", "--config", str(cfg),
           "--steps", str(MAX_STEPS), "--warm-start-steps", str(WARM_START_STEPS),
           "--runs-dir", str(runs)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "=== r3flow local: summary ===" in proc.stdout
    (path,) = list(runs.glob("local-*"))
    return path


def step_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "trainer" / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


def chart_panels() -> int:
    """Panels with at least one query, over every chart dashboard."""
    boards = (ROOT / "helm" / "r3flow" / "dashboards").glob("*.json")
    return sum(1 for b in boards for p in json.loads(b.read_text())["panels"]
               if any(t.get("expr") for t in p.get("targets", [])))
