"""Grafana dashboard JSON for r3flow's panels (services.common.dashboards defines them): every
query limited to the dashboard's namespace and release variables, so several releases can share
one Prometheus."""

from __future__ import annotations

import re
from dataclasses import dataclass

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The labels that tell one deployment from another in a shared Prometheus.
SCOPE = ("namespace", "release")
_SELECTOR_RE = re.compile(r"\b(r3flow_[a-z0-9_]+)\b(\{)?")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""


def scoped(expr: str) -> str:
    """`expr` with every r3flow selector limited to the dashboard's namespace and release."""
    matchers = ", ".join(f'{label}="${label}"' for label in SCOPE)

    def add(m: re.Match[str]) -> str:
        return f"{m.group(1)}{{{matchers}, " if m.group(2) else f"{m.group(1)}{{{matchers}}}"
    return _SELECTOR_RE.sub(add, expr)


def _scope_variables(metric: str) -> list[dict]:
    """Single-choice namespace and release variables (choosing both never mixes deployments)."""
    out, selector = [], metric
    for label in SCOPE:
        out.append({"type": "query", "name": label, "label": label, "datasource": DATASOURCE,
                    "query": f"label_values({selector}, {label})", "refresh": 2, "sort": 1,
                    "multi": False, "includeAll": False})
        selector = f'{metric}{{{label}="${label}"}}'
    return out


def _panel_json(panel: Panel, pid: int) -> dict:
    targets = [{"datasource": DATASOURCE, "expr": scoped(q.expr), "legendFormat": q.legend,
                "refId": chr(ord("A") + i), "range": True} for i, q in enumerate(panel.queries)]
    return {
        "type": "timeseries", "id": pid, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * ((pid - 1) % 2), "y": 8 * ((pid - 1) // 2)},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}},
            "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True,
                               "calcs": []},
                    "tooltip": {"mode": "multi", "sort": "none"}},
    }


def annotation(name: str, expr: str, color: str) -> dict:
    return {"name": name, "datasource": DATASOURCE, "enable": True, "iconColor": color,
            "expr": scoped(expr)}


def dashboard(uid: str, title: str, panels: tuple[Panel, ...], annotations: list[dict],
               scope_metric: str) -> dict:
    datasource_var = {"type": "datasource", "name": "datasource", "label": "Prometheus",
                      "query": "prometheus", "current": {"text": "Prometheus",
                                                         "value": "prometheus"}}
    return {
        "uid": uid, "title": title, "tags": ["r3flow"], "timezone": "browser",
        "editable": True, "graphTooltip": 1, "schemaVersion": 41, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": annotations},
        "templating": {"list": [datasource_var, *_scope_variables(scope_metric)]},
        "panels": [_panel_json(p, i + 1) for i, p in enumerate(panels)],
    }
