"""`r3flow local`: the real processes end to end (redis-server, store, vLLM-CPU rollout,
megatron-core trainer through Ray, weight push over gloo), then the run folder is checked:
every trajectory accounted for, the report written, every dashboard/alert metric exported.

The run is the session's shared one (conftest.py `local_run_dir`, local_fixtures.spike_run): the
tests' small MoE, GRPO steps for SPIKE_AFTER_S seconds, the last of them after a test-only lr
spike (test_local_alerts.py checks the spike and its alert); every check here holds for every
step, except that the routing agreement is checked on the ordinary steps, before the spike.
"""

from __future__ import annotations

import json
from pathlib import Path

from local_fixtures import ROOT, chart_panels, need_prometheus, step_rows
from prometheus_client.parser import text_string_to_metric_families

from services.common import dashboards as gen
from services.common.metric_catalog import ALL


def test_every_trajectory_is_accounted_for(local_run_dir: Path):
    s = json.loads((local_run_dir / "summary.json").read_text())
    t = s["trajectories"]
    steps = len(step_rows(local_run_dir))
    assert s["steps"] == steps >= 3
    g = json.loads((local_run_dir / "config.json").read_text())["grpo"]
    # a group the agreement check quarantines is acked as dropped, not trained (the spike step
    # trains on a policy its lr jump moved: some of its groups can fall below the floor)
    quarantined = sum(r["groups_quarantined"] for r in step_rows(local_run_dir))
    assert sum(t["dropped"].values()) >= quarantined * g["group_size"], t
    assert t["produced"] > 0 and t["trained"] == \
        (steps * g["groups_per_step"] - quarantined) * g["group_size"], (t, quarantined)
    assert 0 < t["workers_reported"] <= t["produced"], t
    assert t["balanced"], t
    assert 0 <= t["in_incomplete_groups"] <= t["max_in_flight"], t
    assert t["trained"] + sum(t["dropped"].values()) + t["unused_at_end"] \
        + t["in_incomplete_groups"] == t["produced"], t


def test_step_log_and_report(local_run_dir: Path):
    run_dir = local_run_dir
    rows = [json.loads(x) for x in (run_dir / "trainer" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 3
    for r in rows:
        assert 0 < r["routing_agreement"] <= 1.0
        assert r["logprob_diff_mean"] >= 0 and r["grad_norm"] > 0
    for r in rows[:-1]:  # the last step trains on the policy the test's lr spike moved away
        assert r["routing_agreement"] > 0.5, r
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    for name in ("config.json", "configs/trainer.json", "configs/store.json", "configs/rollout-0.json"):
        assert (run_dir / name).is_file(), name


def _exported_families(run_dir: Path) -> set[str]:
    names = set()
    for prom in (run_dir / "metrics").glob("*.prom"):
        names |= {f.name for f in text_string_to_metric_families(prom.read_text())}
    return names


def test_every_dashboard_and_alert_metric_is_exported(local_run_dir: Path):
    run_dir = local_run_dir
    exprs = [a.expr for a in gen.ALERTS] + [
        q.expr for p in gen.TRAINING_PANELS + gen.PIPELINE_PANELS for q in p.queries]
    referenced = {gen.catalog_name(m) for e in exprs for m in gen.metrics_in_expr(e)}
    kinds = {spec.name: spec.kind for specs in ALL.values() for spec in specs}
    exported = _exported_families(run_dir)
    missing = sorted(n for n in referenced if n and
                     (n.removesuffix("_total") if kinds[n] == "counter" else n) not in exported)
    assert {p.stem for p in (run_dir / "metrics").glob("*.prom")} >= {"store", "rollout-0", "trainer"}
    assert not missing, f"dashboards/alerts reference metrics no process exported: {missing}"


def test_dashboards_drawn_from_a_real_prometheus(local_run_dir: Path):
    """With a `prometheus` binary on the PATH (make test installs it), the run scraped every
    child with the chart's alert rules and every panel of every chart dashboard got data from
    its own PromQL: no panel is empty because of a wrong metric name or label."""
    need_prometheus()
    run_dir = local_run_dir
    prom = json.loads((run_dir / "summary.json").read_text())["prometheus"]
    assert prom["panels"] == chart_panels() > 0
    assert prom["empty_panels"] == [], prom["empty_panels"]
    assert all(Path(p).stat().st_size > 20_000 for p in prom["dashboards"]), prom["dashboards"]
    assert len(prom["dashboards"]) == len(list((ROOT / "helm/r3flow/dashboards").glob("*.json")))
    rules = (run_dir / "prometheus" / "r3flow-alerts.yaml").read_text()
    assert rules == (ROOT / "helm/r3flow/rules/r3flow-alerts.yaml").read_text()
    assert isinstance(prom["alerts_fired"], list)
