"""Dashboards, alert rules and docs/metrics.md are generated from the metric catalog and current;
no panel, annotation or alert points at a metric nobody exports."""

from __future__ import annotations

import json
import re

import yaml
from conftest import CHART, ROOT, find

from services.common import dashboards as gen


def test_committed_files_are_generated_and_current():
    for rel, text in gen.render_all().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} missing: run python -m services.common.dashboards"
        assert path.read_text() == text, f"{rel} is stale: run python -m services.common.dashboards"


def _exprs_of_dashboard(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]


def _unknown_metrics(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in gen.metrics_in_expr(e) if gen.catalog_name(m) is None}


def test_every_referenced_metric_is_in_the_catalog():
    exprs = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        exprs += _exprs_of_dashboard(json.loads(path.read_text()))
    rules = yaml.safe_load((CHART / "rules" / "r3flow-alerts.yaml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert len(exprs) > 30
    assert not _unknown_metrics(exprs)
    used = {gen.catalog_name(m) for e in exprs for m in gen.metrics_in_expr(e)}
    # The issue's panel list, by metric: each of these must be on a dashboard.
    for name in ("r3flow_trainer_ppo_kl", "r3flow_trainer_kl_ref",
                 "r3flow_trainer_logprob_diff_max", "r3flow_trainer_routing_agreement_ratio",
                 "r3flow_trainer_clip_ratio", "r3flow_store_backlog_tokens",
                 "r3flow_store_routing_encoded_bytes_total", "r3flow_store_redeliveries_total",
                 "r3flow_trainer_weight_push_seconds", "r3flow_rollout_policy_version"):
        assert name in used, name


def test_unknown_metric_is_refused():
    assert _unknown_metrics(["rate(r3flow_store_appendz_total[5m])"]) == {
        "r3flow_store_appendz_total"}
    assert gen.catalog_name("r3flow_trainer_step_seconds_bucket") == "r3flow_trainer_step_seconds"
    assert gen.catalog_name("r3flow_trainer_ppo_kl_bucket") is None  # a gauge has no buckets


def test_alerts_cover_the_issue_list():
    names = {a.name for a in gen.ALERTS}
    assert names == {"R3flowPpoKlSpike", "R3flowKlRefSpike", "R3flowRoutingAgreementLow",
                     "R3flowStoreBacklogGrowing", "R3flowRolloutStalePolicy",
                     "R3flowTrainerGroupsQuarantined", "R3flowTrainerStalled"}
    # a stall is judged against the run's own step time (with a floor), never before a step
    assert "5 * max by (namespace, release) (max_over_time(r3flow_trainer_step_interval_seconds" \
        in gen.TRAINER_STALLED and "r3flow_trainer_last_step_timestamp_seconds) > 0" \
        in gen.TRAINER_STALLED
    # ppo_kl is judged against its own recent median, not a fixed number, over the samples
    # taken after the trainer's first step (the gauge's start-up zeros are left out).
    assert "quantile_over_time(0.5, (r3flow_trainer_ppo_kl and r3flow_trainer_steps_total > 0)" \
        in gen.PPO_KL_SPIKE


def test_chart_embeds_the_generated_rules_and_dashboards(rendered):
    docs = rendered["production"]
    rule = find(docs, "PrometheusRule")[0]
    assert rule["spec"] == gen.rules_document()
    boards = {k: json.loads(v) for cm in find(docs, "ConfigMap")
              if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
              for k, v in cm["data"].items()}
    assert boards == gen.dashboards()
    assert not find(rendered["defaults"], "PrometheusRule")  # behind its enabled flag


def test_metrics_doc_lists_every_metric():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for name in gen.CATALOG:
        assert f"`{name}`" in doc


_AGGREGATION_RE = re.compile(
    r"\b(sum|min|max|avg|count|stddev|stdvar|topk|bottomk|quantile)\s*(?:by\s*\(([^)]*)\)\s*)?\(")
_JOIN_RE = re.compile(r"\b(on|ignoring)\s*\(([^)]*)\)")


def _scope_problems(expr: str) -> list[str]:
    """Aggregations or joins in an alert expression that would mix two deployments."""
    out = []
    for m in _AGGREGATION_RE.finditer(expr):
        labels = {x.strip() for x in (m.group(2) or "").split(",")}
        if not set(gen.SCOPE) <= labels:
            out.append(f"{m.group(0)!r} aggregates across {gen.SCOPE}")
    for m in _JOIN_RE.finditer(expr):
        labels = {x.strip() for x in m.group(2).split(",")}
        if m.group(1) == "ignoring" or not set(gen.SCOPE) <= labels:
            out.append(f"{m.group(0)!r} joins across {gen.SCOPE}")
    return out


def test_alerts_never_aggregate_or_join_across_deployments():
    for alert in gen.ALERTS:
        assert not _scope_problems(alert.expr), alert.name
    # The check itself: the pre-fix stale-policy rule is refused.
    assert _scope_problems("r3flow_rollout_policy_version < on() group_left() "
                           "(max(r3flow_trainer_policy_version) - 2)")


def test_every_dashboard_query_is_scoped_to_one_deployment():
    scope = ", ".join(f'{label}="${label}"' for label in gen.SCOPE)
    for name, dash in gen.dashboards().items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        for label in gen.SCOPE:
            assert variables[label]["multi"] is False and not variables[label]["includeAll"]
        for expr in _exprs_of_dashboard(dash):
            selectors = re.findall(r"\br3flow_[a-z0-9_]+\b\{?[^}\[]*", expr)
            assert selectors
            for sel in selectors:
                assert sel.split("{", 1)[-1].startswith(scope), (name, expr)


def test_service_monitor_labels_every_target_with_its_release(rendered):
    monitor = find(rendered["production"], "ServiceMonitor")[0]
    relabel = monitor["spec"]["endpoints"][0]["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_instance"],
            "targetLabel": "release"} in relabel
