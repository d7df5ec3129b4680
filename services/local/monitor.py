"""What a local run watches while it trains: every child's /metrics endpoint (the latest text
kept under metrics/) and, when the binary is on the PATH, a real Prometheus (prom.LocalPrometheus)
evaluating the chart's alert rules: `stop_on_alert`, and the end-of-run report of the alerts that
fired and the dashboards drawn."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from services.common.net import free_port
from services.local.config import LocalConfig
from services.local.prom import SCRAPE_S, LocalPrometheus, plot_dashboards

SNAPSHOT_EVERY_S = 5.0  # /metrics snapshots while the trainer steps


class RunMonitor:
    """The run's metrics endpoints, their snapshots, and its Prometheus (None without one)."""

    def __init__(self, cfg: LocalConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.dir = run_dir
        self.urls: dict[str, str] = {}  # child -> its /metrics URL
        self.prom: LocalPrometheus | None = None
        self._last_scrape = self._last_alert_check = 0.0
        self.stopped_by_alert: str | None = None  # stop_on_alert, once it ended the run

    def add(self, name: str, port: int) -> None:
        """Child `name` serves its metrics on loopback `port`."""
        self.urls[name] = f"http://127.0.0.1:{port}/metrics"

    def start_prometheus(self) -> None:
        """A real Prometheus scraping every child with the chart's alert rules, when the
        binary is on the PATH (else one line, and the run goes on without it)."""
        if not self.cfg.prometheus:
            tqdm.write("prometheus: off (config prometheus: false): no alerts evaluated, "
                       "dashboards not rendered")
            return
        binary = LocalPrometheus.binary_on_path()
        if binary is None:
            tqdm.write("prometheus: not on the PATH (Debian package `prometheus`): no alerts "
                       "evaluated, dashboards not rendered" + (
                           f", stop_on_alert {self.cfg.stop_on_alert} never fires"
                           if self.cfg.stop_on_alert else ""))
            return
        self.prom = LocalPrometheus(binary, self.dir / "prometheus", free_port())
        self.prom.start(self.urls)

    def report(self) -> dict:
        """Alerts that fired and every dashboard panel drawn from its own PromQL (PNG per
        dashboard under dashboards/); {} without a Prometheus."""
        if self.prom is None:
            return {}
        end = time.time()
        time.sleep(3)  # one more scrape and rule evaluation of the last step
        alerts = self.prom.alerts_fired(self.prom.started, time.time())
        panels = self.prom.dashboard_data(self.prom.started, time.time())
        pngs = plot_dashboards(panels, self.dir / "dashboards", self.prom.started)
        rel = lambda t: round(t - self.prom.started, 1)  # noqa: E731
        return {"url": self.prom.url, "started": self.prom.started,
                "seconds": round(end - self.prom.started, 1),
                "alerts_fired": [{**a, "first": rel(a["first"]), "last": rel(a["last"])}
                                 for a in alerts],
                "dashboards": [str(p) for p in pngs],
                "panels": len(panels),
                "empty_panels": [f"{p.dashboard} / {p.title}" for p in panels if p.empty]}

    def alert_fired(self) -> bool:
        """Whether `stop_on_alert` has been evaluated as firing twice (checked once per rule
        evaluation); its name goes to `stopped_by_alert` in the summary."""
        alert = self.cfg.stop_on_alert
        if alert is None or self.prom is None or \
                time.monotonic() - self._last_alert_check < SCRAPE_S:
            return False
        self._last_alert_check = time.monotonic()
        if self.prom.firing_evaluations(alert) < 2:
            return False
        tqdm.write(f"prometheus: {alert} fired (stop_on_alert): stopping the trainer")
        self.stopped_by_alert = alert
        return True

    def snapshot_due(self) -> bool:
        return time.monotonic() - self._last_scrape > SNAPSHOT_EVERY_S

    def snapshot(self) -> None:
        """Keep the latest /metrics text of every live child under metrics/ (for the report and
        for checking that every dashboard/alert metric is really exported)."""
        self._last_scrape = time.monotonic()
        out = self.dir / "metrics"
        out.mkdir(exist_ok=True)
        for name, url in self.urls.items():
            try:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                continue  # a child that already exited keeps its last snapshot
            (out / f"{name}.prom").write_text(text)

    def print_endpoints(self) -> None:
        if self.prom is not None:
            tqdm.write(f"prometheus {self.prom.url} (the chart's alert rules; data in "
                       f"{self.prom.dir})")
        for name, url in self.urls.items():
            tqdm.write(f"metrics: {name:<10} {url}")

    def stop(self) -> None:
        if self.prom is not None:
            self.prom.stop()
