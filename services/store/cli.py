"""`r3flow store`: serve the TrajectoryStore gRPC service over Redis (embedded unless given)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from services.common.errors import UserError, command_main

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="StoreConfig file (.toml/.yaml/.json)")
    parser.add_argument("--listen", help="gRPC address (default from config: 127.0.0.1:50051)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics and /health")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="external Redis (default: $REDIS_URL, else an embedded redis-server)")


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    pairs = {"listen": args.listen, "metrics_port": args.metrics_port,
             "redis_url": args.redis_url}
    return {k: v for k, v in pairs.items() if v is not None}


def load(args: argparse.Namespace):
    """The StoreConfig and the Redis password (read from its file): every input, validated."""
    from services.common.config import load_config
    from services.store.config import StoreConfig

    cfg = load_config(StoreConfig, args.config, _overrides(args))
    return cfg, _redis_password(cfg)


def run(args: argparse.Namespace) -> int:
    from services.store.malloc_tuning import keep_freed_memory
    from services.store.redis_server import EmbeddedRedis

    cfg, password = load(args)
    keep_freed_memory(cfg.malloc_keep_bytes)  # before the first large allocation
    stop = _stop_on_signals()  # before serving: a SIGTERM right after startup is still graceful
    if cfg.redis_url is not None:
        return _serve(cfg, cfg.redis_url, password, stop)
    rc = cfg.redis
    embedded = EmbeddedRedis(rc.data_dir, appendfsync=rc.appendfsync, executable=rc.executable,
                             die_with_parent=True, password=password).start()
    try:
        return _serve(cfg, embedded.url, password, stop)
    finally:
        embedded.stop()


def _redis_password(cfg) -> str | None:  # noqa: ANN001 (StoreConfig)
    from services.common.auth import read_secret

    if cfg.redis_password_file is None:
        return None
    return read_secret(cfg.redis_password_file, "redis_password_file").decode()


def _serve(cfg, url: str, password: str | None,  # noqa: ANN001 (StoreConfig)
           stop: threading.Event) -> int:
    """Serve until `stop` is set (or a background duty failed: exit code 1, its cause already
    logged in one line): gRPC store + /metrics, over the Redis at `url`."""
    import redis
    from prometheus_client import CollectorRegistry

    from services.common.auth import redact_url
    from services.common.metrics import MetricsServer
    from services.store.core import TrajectoryStoreCore
    from services.store.server import StoreServer

    # A password in the URL wins over redis_password_file (redis-py: URL options override).
    client = redis.Redis.from_url(url, password=password,
                                  socket_timeout=(cfg.max_wait_ms / 1000) + 10,
                                  socket_connect_timeout=2, health_check_interval=10)
    _wait_for_redis(client, url)
    registry = CollectorRegistry()
    core = TrajectoryStoreCore(client, cfg, registry)
    server = StoreServer(cfg, core, on_fatal=stop.set)
    metrics = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port,
                            health_fn=lambda: server.redis_ok).start()
    server.start()  # gRPC health turns SERVING only now, with /metrics already up
    log.info("store ready: grpc port %d, metrics %s, redis %s", server.port, metrics.url,
             redact_url(url))
    stop.wait()
    server.stop()
    metrics.stop()
    return 0 if server.fatal is None else 1


def _wait_for_redis(client, url: str, timeout_s: float = 60.0) -> None:  # noqa: ANN001
    """Redis may come up after the store (Kubernetes starts pods in any order)."""
    import time

    import redis

    from services.common.auth import redact_url

    url = redact_url(url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
            if time.monotonic() > deadline:
                raise UserError(f"redis_url: {url} unreachable for {timeout_s:.0f}s: {e}") from e
            log.info("waiting for redis at %s: %s", url, e)
            time.sleep(1.0)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def main(argv: list[str] | None = None) -> int:
    """`python -m services.store.cli` (same as `r3flow store`, without the other subcommands)."""
    return command_main("store", add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
