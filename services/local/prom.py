"""A real Prometheus for `r3flow local`: scrapes every child of the run, evaluates the chart's
own alert rules, and afterwards answers the chart's own dashboard queries.

Started only when a `prometheus` binary is on the PATH (Debian's `prometheus` package; `make
test` installs it); it listens on loopback and keeps its data in the run folder. Every target
gets the labels the chart's ServiceMonitor gives a deployment (`namespace`, `release`, `pod`),
so the alert rules and the dashboards' `$namespace`/`$release` filters work unchanged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

CHART = Path(__file__).resolve().parents[2] / "helm" / "r3flow"
RULES = CHART / "rules" / "r3flow-alerts.yaml"
DASHBOARDS = CHART / "dashboards"
LABELS = {"namespace": "local", "release": "local"}  # what the dashboards' variables select
SCRAPE_S = 2


@dataclass
class PanelData:
    """What one dashboard panel's queries returned over the run."""

    dashboard: str
    title: str
    exprs: list[str]
    series: list[list[dict]]  # per query: Prometheus range-query result (matrix)
    legends: list[str]  # per query: Grafana's legendFormat ('' when the panel has none)

    @property
    def empty(self) -> bool:
        return not any(self.series)


def chart_alerts() -> list[str]:
    """Names of the chart's alert rules (RULES), in file order."""
    doc = yaml.safe_load(RULES.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


class LocalPrometheus:
    """One Prometheus process (by pid) with its config and data under `<run>/prometheus`."""

    def __init__(self, binary: str, folder: Path, port: int) -> None:
        self.binary = binary
        self.dir = folder
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @staticmethod
    def binary_on_path() -> str | None:
        return shutil.which("prometheus")

    def start(self, targets: dict[str, str], ready_timeout_s: float = 60.0) -> None:
        """Scrape `targets` (child name -> its /metrics URL) with the chart's alert rules."""
        self.dir.mkdir(parents=True, exist_ok=True)
        config = self.dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config(targets), sort_keys=False))
        out = (self.dir / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        out.close()
        self.started = time.time()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see "
                                   f"{self.dir / 'prometheus.log'}")
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready after {ready_timeout_s:.0f}s")

    def _config(self, targets: dict[str, str]) -> dict:
        rules = self.dir / "r3flow-alerts.yaml"
        shutil.copyfile(RULES, rules)
        jobs: dict[str, list[dict]] = {}
        for name, url in targets.items():
            parsed = urllib.parse.urlparse(url)
            job = name.split("-")[0]  # store, rollout, trainer: the chart's components
            jobs.setdefault(job, []).append(
                {"targets": [parsed.netloc], "labels": {**LABELS, "pod": name}})
        return {"global": {"scrape_interval": f"{SCRAPE_S}s",
                           "evaluation_interval": f"{SCRAPE_S}s"},
                "rule_files": [str(rules)],
                "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                                    "static_configs": static}
                                   for job, static in jobs.items()]}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)

    # ------------------------------------------------------------------ queries
    def _get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body.get('error', body)}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        data = self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                         end=f"{end:.3f}", step=f"{SCRAPE_S}s")
        return [s for s in data["result"]
                if any(math.isfinite(float(v)) for _, v in s["values"])]

    def firing_evaluations(self, alert: str, window_s: float = 10.0) -> int:
        """How many of the rule evaluations in the last `window_s` seconds had `alert` firing
        (0 before it fires)."""
        data = self._get("/api/v1/query", query=f'count_over_time(ALERTS{{alertname="{alert}",'
                         f'alertstate="firing"}}[{window_s:.0f}s])')
        return max((int(float(s["value"][1])) for s in data["result"]), default=0)

    def alerts_fired(self, start: float, end: float) -> list[dict]:
        """Every alert that was firing during [start, end]: name, labels, first and last
        evaluation at which it fired (unix seconds)."""
        fired = []
        for s in self.query_range('ALERTS{alertstate="firing"}', start, end):
            labels = {k: v for k, v in s["metric"].items() if k not in ("__name__",)}
            times = [float(t) for t, _ in s["values"]]
            fired.append({"alert": labels.pop("alertname", "?"), "labels": labels,
                          "first": min(times), "last": max(times)})
        return sorted(fired, key=lambda a: a["first"])

    def dashboard_data(self, start: float, end: float) -> list[PanelData]:
        """Every panel of every chart dashboard, its queries run over [start, end]."""
        panels = []
        for path in sorted(DASHBOARDS.glob("*.json")):
            board = json.loads(path.read_text())
            for panel in board.get("panels", []):
                targets = [t for t in panel.get("targets", []) if t.get("expr")]
                exprs = [_fill(t["expr"]) for t in targets]
                if exprs:
                    panels.append(PanelData(board.get("title", path.stem), panel.get("title", ""),
                                            exprs, [self.query_range(e, start, end)
                                                    for e in exprs],
                                            [t.get("legendFormat", "") for t in targets]))
        return panels


def _fill(expr: str) -> str:
    """The dashboards' template variables as Grafana would set them for this run."""
    for name, value in LABELS.items():
        expr = expr.replace(f"${name}", value).replace(f"${{{name}}}", value)
    return expr


def _legend(fmt: str, metric: dict[str, str]) -> str:
    """Grafana's legendFormat (`{{pod}} p99`) filled from a series' labels; without one, the
    labels that tell series apart."""
    if fmt:
        return re.sub(r"{{\s*(\w+)\s*}}", lambda m: metric.get(m.group(1), ""), fmt)
    return ",".join(f"{k}={v}" for k, v in metric.items()
                    if k not in ("__name__", "namespace", "release", "job", "instance"))


def plot_dashboards(panels: list[PanelData], out_dir: Path, t0: float) -> list[Path]:
    """One PNG per dashboard: each panel's queries as lines over the run (seconds from t0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for board in dict.fromkeys(p.dashboard for p in panels):
        mine = [p for p in panels if p.dashboard == board]
        cols = 3
        rows = -(-len(mine) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, mine, strict=False):
            for expr_series, legend in zip(panel.series, panel.legends, strict=True):
                for s in expr_series:
                    xs = [float(t) - t0 for t, _ in s["values"]]
                    ys = [float(v) for _, v in s["values"]]
                    ax.plot(xs, ys, label=_legend(legend, s["metric"]) or None)
            ax.set_title(panel.title + (" (no data)" if panel.empty else ""), fontsize=9)
            ax.set_xlabel("s since start", fontsize=8)
            ax.grid(alpha=0.3)
            if any(ax.get_legend_handles_labels()[1]):
                ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(mine):]:
            ax.axis("off")
        fig.suptitle(f"{board} — from the chart's PromQL against this run's Prometheus")
        fig.tight_layout()
        path = out_dir / f"{re.sub(r'[^a-z0-9]+', '-', board.lower()).strip('-')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
