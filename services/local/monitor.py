"""What a local run watches while it trains: every child's /metrics endpoint (the latest text
kept under metrics/) and, when the binary is on the PATH, a real Prometheus (prom.LocalPrometheus)
evaluating the chart's alert rules: `stop_on_alert`, and the end-of-run report of the alerts that
fired and the dashboards drawn."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from services.common.net import free_port
from services.local.config import LocalConfig
from services.local.prom import SCRAPE_S, LocalPrometheus, plot_dashboards

log = logging.getLogger(__name__)

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

    def unhealthy(self, name: str) -> bool:
        """Whether child `name`'s /health answers 503 (a rollout worker: its engine died)."""
        url = self.urls[name].removesuffix("/metrics") + "/health"
        try:
            urllib.request.urlopen(url, timeout=5).read()
        except urllib.error.HTTPError as e:
            return e.code == 503
        except OSError:
            return False  # not answering at all: the process check names it
        return False

    def text(self, name: str) -> str:
        """Child `name`'s /metrics text now."""
        return urllib.request.urlopen(self.urls[name], timeout=5).read().decode()

    def print_endpoints(self) -> None:
        if self.prom is not None:
            tqdm.write(f"prometheus {self.prom.url} (the chart's alert rules; data in "
                       f"{self.prom.dir})")
        for name, url in self.urls.items():
            tqdm.write(f"metrics: {name:<10} {url}")

    def stop(self) -> None:
        if self.prom is not None:
            self.prom.stop()


# ---- stalls ---------------------------------------------------------------------------------
STALL_FACTOR = 5.0  # no step for this many times the recent step time: the run stalled
STALL_MIN_S = 120.0  # and at least this long (slow steps on a loaded 2-core box are no stall)
RECENT_STEPS = 5  # the recent step time: the longest of the last gaps between step records


@dataclass(frozen=True)
class StoreFacts:
    """What the store says about the pipeline: its stats, its registered workers and its
    refusals so far by limit (r3flow_store_rejections_total)."""

    groups_ready: int
    groups_leased: int
    groups_open: int
    groups_delivered: int
    workers: int
    refused: dict[str, float]
    undelivered_tokens: float
    unacked_tokens: float

    @classmethod
    def read(cls, stats, workers: list, metrics_text: str) -> StoreFacts:  # noqa: ANN001
        """From StoreClient.stats() (read first: it refreshes the gauges), list_workers() and
        the text of the store's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        refused: dict[str, float] = {}
        gauges: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == "r3flow_store_rejections_total":
                    refused[sample.labels["reason"]] = sample.value
                else:
                    gauges[sample.name] = sample.value
        return cls(stats.groups_ready, stats.groups_leased, stats.groups_open,
                   stats.groups_delivered, len(workers), refused,
                   gauges.get("r3flow_store_backlog_tokens", 0.0),
                   gauges.get("r3flow_store_unacked_tokens", 0.0))


# the store's refusal reasons -> what is full
_FULL = {"backlog": "admission budget (max_backlog_tokens)",
         "groups_ahead": "admission budget (max_groups_ahead)",
         "inflight": "in-flight trajectories (max_inflight_trajectories)",
         "unacked": "delivered, not yet acked groups (max_unacked_tokens)",
         "redis_full": "Redis memory (maxmemory)"}


def stall_cause(dead: dict[str, str], then: StoreFacts, now: StoreFacts) -> tuple[str, str]:
    """(component, cause) of a stall, from the rollout children found dead (name -> why) and
    the store's facts at the last step (`then`) and now."""
    if dead:
        name = sorted(dead)[0]
        return name, dead[name]
    if not now.workers:
        return "rollout", "no rollout worker connected (none registered with the store)"
    if now.groups_ready and now.groups_delivered == then.groups_delivered:
        return "trainer", (f"trainer not pulling: {now.groups_ready} groups ready, none "
                           "delivered since the last step")
    refused = {r: n - then.refused.get(r, 0.0) for r, n in now.refused.items()}
    refused = {r: n for r, n in refused.items() if n > 0 and r in _FULL}
    if refused:
        reason = max(refused, key=lambda r: refused[r])
        return "store", (f"budget full: {refused[reason]:.0f} requests refused by the "
                         f"{_FULL[reason]}; held: {now.undelivered_tokens:.0f} tokens "
                         f"undelivered, {now.unacked_tokens:.0f} delivered and not yet acked, "
                         f"{now.groups_open} groups open, {now.groups_leased} leased")
    return "rollout", (f"no group completes: {now.workers} worker(s) registered, "
                       f"{now.groups_open} groups open, none ready")


class StallWatch:
    """Whether the trainer stopped stepping for STALL_FACTOR x its recent step time, and why:
    the store's facts are read at every step and again at the stall (`facts` reads them)."""

    def __init__(self, facts: Callable[[], StoreFacts]) -> None:
        self.facts = facts
        self.steps = 0
        self.last_step_at = 0.0  # monotonic
        self.at_step: StoreFacts | None = None

    def limit(self, step_times: list[float]) -> float | None:
        """Seconds without a step that make a stall (None before two steps: the budget's
        boot allowance covers the first)."""
        gaps = [b - a for a, b in zip(step_times, step_times[1:], strict=False)]
        if not gaps:
            return None
        return max(STALL_MIN_S, STALL_FACTOR * max(gaps[-RECENT_STEPS:]))

    def idle(self, step_times: list[float], now: float) -> float | None:
        """Seconds since the last step once over the limit, else None; at a new step the
        store's facts are read (the baseline of the next stall)."""
        if len(step_times) > self.steps:
            self.steps, self.last_step_at = len(step_times), now
            self.at_step = self._read() or self.at_step
            return None
        limit = self.limit(step_times)
        idle = now - self.last_step_at
        return idle if limit is not None and idle > limit else None

    def cause(self, dead: dict[str, str]) -> tuple[str, str]:
        """(component, cause) now, against the facts of the last step."""
        now = self._read()
        if now is None:
            return "store", "not answering (stats, workers or /metrics)"
        return stall_cause(dead, self.at_step or now, now)

    def _read(self) -> StoreFacts | None:
        try:
            return self.facts()
        except Exception as e:  # noqa: BLE001 (a store that does not answer is a cause itself)
            log.warning("store facts unavailable: %s", e)
            return None
