"""Per-process Prometheus metrics: a private registry served on `/metrics`, plus `/health`.

Every process owns one `MetricsServer`; metric objects are created against its registry, so
tests can run several processes' worth of metrics in one interpreter without collisions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# `_created` series double every counter's cardinality and no dashboard reads them.
disable_created_metrics()


class MetricsServer:
    """Serves `registry` on http://host:port/metrics and a JSON `/health` from `health_fn`."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 health_fn: Callable[[], bool] | None = None) -> None:
        self.registry = registry
        self._health_fn = health_fn or (lambda: True)
        handler = self._make_handler()
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._httpd.server_address[0])
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.startswith("/metrics"):
                    body, ctype, code = generate_latest(server.registry), CONTENT_TYPE_LATEST, 200
                elif self.path.startswith("/health"):
                    ok = bool(server._health_fn())
                    body = b'{"status": "ok"}' if ok else b'{"status": "unhealthy"}'
                    ctype, code = "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


def create_metrics(registry: CollectorRegistry, component: str) -> dict[str, object]:
    """Create every catalogued metric of `component` on `registry`; returns name -> metric."""
    from prometheus_client import Counter, Gauge, Histogram

    from services.common.metric_catalog import ALL

    out: dict[str, object] = {}
    for spec in ALL[component]:
        name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        if spec.kind == "counter":
            out[spec.name] = Counter(name, spec.help, spec.labels, registry=registry)
            for value in spec.initial:
                out[spec.name].labels(value)  # type: ignore[attr-defined]
        elif spec.kind == "gauge":
            out[spec.name] = Gauge(spec.name, spec.help, spec.labels, registry=registry)
        else:
            out[spec.name] = Histogram(spec.name, spec.help, spec.labels, registry=registry,
                                       buckets=spec.buckets or Histogram.DEFAULT_BUCKETS)
    return out
