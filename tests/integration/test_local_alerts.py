"""`r3flow local` with an injected ppo_kl spike, against a real Prometheus: the chart's own
R3flowPpoKlSpike rule (unchanged, `for: 1m`) fires, and every query of every chart dashboard
panel returns data from the run.

The run (local_fixtures.spike_run, shared with test_local_run.py) runs the update of the first
step SPIKE_AFTER_S seconds into the run at a multiplied learning rate and ends one step later;
the trainer keeps serving its /metrics until the alert has fired (the run's `stop_on_alert`;
`metrics_linger_s` bounds the hold), so Prometheus sees the spike held for longer than the rule's
`for`. The rule compares against the 30-minute median of the same
gauge over the samples taken after the trainer's first step (the gauge reads 0 from start-up
until then, and those zeros are left out of the median), so the low values of the steps before
the spike must outnumber the held spike until the alert fires: the run has enough steps before
it, and the test checks that precondition. Since a long boot no longer pulls the median to 0,
nothing may fire before the spike."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from local_fixtures import (
    ALERT,
    FOR_S,
    MAX_STEPS,
    ROOT,
    SPIKE_AFTER_S,
    chart_panels,
    need_prometheus,
    step_rows,
)


@pytest.fixture()
def run_dir(request: pytest.FixtureRequest) -> Path:
    need_prometheus()  # before the run: without Prometheus there is nothing to check here
    return request.getfixturevalue("local_run_dir")


def test_the_injected_spike_is_in_the_step_log(run_dir: Path):
    rows = step_rows(run_dir)
    kls = [r["ppo_kl"] for r in rows]
    assert 3 <= len(kls) < MAX_STEPS  # the timed spike ended the run
    assert rows[-2]["time"] - rows[0]["time"] >= SPIKE_AFTER_S - 1, rows  # not before its time
    before = statistics.median(kls[:-1])
    assert kls[-1] > 5 * before and kls[-1] > 5e-4, (kls[-1], before, kls)


def test_ppo_kl_spike_alert_fires_in_prometheus(run_dir: Path):
    summary = json.loads((run_dir / "summary.json").read_text())
    prom = summary["prometheus"]
    rows = step_rows(run_dir)
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
    # the hold ended on the alert (stop_on_alert), not by waiting out metrics_linger_s
    assert summary["stopped_by_alert"] == ALERT, summary["stops"]
    assert summary["stops"]["trainer"]["killed"] is False, summary["stops"]


def test_every_dashboard_panel_has_data(run_dir: Path):
    prom = json.loads((run_dir / "summary.json").read_text())["prometheus"]
    boards = list((ROOT / "helm" / "r3flow" / "dashboards").glob("*.json"))
    assert prom["panels"] == chart_panels() > 0
    assert prom["empty_panels"] == [], prom["empty_panels"]
    assert len(prom["dashboards"]) == len(boards)
