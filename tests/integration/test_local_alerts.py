"""`r3flow local` with an injected ppo_kl spike, against a real Prometheus: the chart's own
R3flowPpoKlSpike rule (unchanged, `for: 1m`) fires, and every query of every chart dashboard
panel returns data from the run.

The spike is real: `grpo.test_lr_spike_after_s` (a test-only knob) runs the update of the first
step SPIKE_AFTER_S seconds into the run at a multiplied learning rate, so the next step's batch,
sampled by the policy before the jump, sits far from the trainer's policy. That step is the last
one (the knob ends the run there; picking the step by time, not by count, keeps the low ppo_kl
long enough however fast the machine steps, and no longer), and the trainer keeps serving its
/metrics for `metrics_linger_s`, so Prometheus sees the spike held for longer than the rule's
`for`. The rule compares against the 30-minute median of the same gauge over the samples taken after
the trainer's first step (the gauge reads 0 from start-up until then, and those zeros are left
out of the median), so the low values of the steps before the spike must outnumber the held spike
until the alert fires: the run has enough steps before it, and the test checks that
precondition. Since a long boot no longer pulls the median to 0, nothing may fire before the
spike."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Long enough that the low ppo_kl of the steps before the spike outlasts the rule's `for` with
# room to spare (a fixed 160 steps took 98 s on a quiet CI box and 340 s on a busy one).
SPIKE_AFTER_S = 80
MAX_STEPS = 1000  # an upper bound the timed spike ends the run well before
FACTOR = 20.0
FOR_S = 60  # the chart rule's `for`
HOLD_S = 100  # trainer metrics_linger_s: the last step's ppo_kl, held past FOR_S
ALERT = "R3flowPpoKlSpike"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not on the PATH under CI (scripts/install_prometheus.sh)")
        pytest.skip("no prometheus binary on the PATH")
    runs = tmp_path_factory.mktemp("runs")
    cfg = tmp_path_factory.mktemp("cfg") / "spike.json"
    cfg.write_text(json.dumps({
        "grpo": {"groups_per_step": 8, "steps": MAX_STEPS, "lr": 1e-3,
                 "test_lr_spike_after_s": SPIKE_AFTER_S, "test_lr_spike_factor": FACTOR},
        "model": {},  # the tests' small MoE (TinyMoeConfig defaults): quicker than the run's
        "metrics_linger_s": HOLD_S, "warm_start_steps": 5, "runs_dir": str(runs)}))
    cmd = [sys.executable, "-m", "services.cli", "local", "--config", str(cfg)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (path,) = list(runs.glob("local-*"))
    return path


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "trainer" / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r]


def test_the_injected_spike_is_in_the_step_log(run_dir: Path):
    rows = _rows(run_dir)
    kls = [r["ppo_kl"] for r in rows]
    assert 3 <= len(kls) < MAX_STEPS  # the timed spike ended the run
    assert rows[-2]["time"] - rows[0]["time"] >= SPIKE_AFTER_S - 1, rows  # not before its time
    before = statistics.median(kls[:-1])
    assert kls[-1] > 5 * before and kls[-1] > 5e-4, (kls[-1], before, kls)


def test_ppo_kl_spike_alert_fires_in_prometheus(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    prom = summary["prometheus"]
    rows = _rows(run_dir)
    started = prom["started"]  # unix time; alert times are seconds from it
    spike = rows[-1]["time"] - started  # the spike step, seconds after Prometheus started
    stepping = rows[-1]["time"] - rows[0]["time"]  # low ppo_kl samples the median counts
    assert stepping > FOR_S + 5, \
        f"precondition: only {stepping:.0f} s of low ppo_kl steps before the spike (need more " \
        f"than the rule's `for`, else the spike itself becomes the 30-minute median)"
    fired = [a for a in prom["alerts_fired"] if a["alert"] == ALERT]
    assert fired, f"{ALERT} did not fire; fired: {prom['alerts_fired']}"
    # nothing before the spike (boot zeros are not in the median); firing while it is held,
    # more than the rule's `for` after the step logged it
    assert fired[0]["first"] >= spike, (fired, spike)
    assert fired[0]["last"] >= spike + FOR_S, (fired, spike)
    assert fired[0]["labels"]["pod"] == "trainer"


def test_every_dashboard_panel_has_data(run_dir: Path):
    prom = json.loads((run_dir / "summary.json").read_text())["prometheus"]
    boards = list((ROOT / "helm" / "r3flow" / "dashboards").glob("*.json"))
    panels = sum(1 for b in boards for p in json.loads(b.read_text())["panels"]
                 if any(t.get("expr") for t in p.get("targets", [])))
    assert prom["panels"] == panels > 0
    assert prom["empty_panels"] == [], prom["empty_panels"]
    assert len(prom["dashboards"]) == len(boards)
