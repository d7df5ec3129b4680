"""Process wiring of `r3flow rollout`: metrics server, engine, dataset, store, worker."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.metrics import MetricsServer, create_metrics
from services.rollout.config import RolloutConfig

log = logging.getLogger(__name__)


def _watch_trainer_version(client: Any, worker: Any, loop: asyncio.AbstractEventLoop,
                           stop: threading.Event) -> None:
    """Thread body: mirror the store's published policy version into `worker.trainer_version`."""
    for version in client.watch_policy_version(-1):
        if stop.is_set():
            return
        loop.call_soon_threadsafe(setattr, worker, "trainer_version", version)


def _open_store(cfg: RolloutConfig) -> Any:
    from services.store.client import StoreClient

    client = StoreClient(cfg.store, timeout_s=cfg.store_timeout_s,
                         max_retries=cfg.store_max_retries)
    client.wait_ready(cfg.store_timeout_s)
    return client


async def serve(cfg: RolloutConfig) -> int:
    """Run the worker to the end of its dataset; returns the exit code."""
    from transformers import AutoTokenizer

    from services.rollout.dataset import load_dataset
    from services.rollout.engine import RolloutEngine
    from services.rollout.sink import StoreSink
    from services.rollout.worker import RolloutWorker, load_environment_factory

    records = load_dataset(cfg.dataset)
    env_factory = load_environment_factory(cfg.environment)
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "rollout")
    client = _open_store(cfg) if cfg.store else None
    engine = RolloutEngine.start(cfg.engine, metrics)
    server = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port,
                           health_fn=lambda: not engine.llm.errored).start()
    log.info("rollout metrics on %s", server.url)
    sink = StoreSink(client, cfg.backpressure_sleep_s) if client is not None else None
    stop = threading.Event()
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.engine.model)
        worker = RolloutWorker(cfg, engine, sink, tokenizer, env_factory)
        await worker.report_version()
        if client is not None and cfg.max_policy_lag is not None:
            threading.Thread(target=_watch_trainer_version, name="policy-watch", daemon=True,
                             args=(client, worker, asyncio.get_running_loop(), stop)).start()
        summary = await worker.run(records)
        log.info("rollout done: %d groups ok, %d failed, %d tokens in %.1fs (%.1f tok/s)",
                 summary.groups_ok, summary.groups_failed, summary.generated_tokens,
                 summary.seconds, summary.generated_tokens / max(summary.seconds, 1e-9))
        return 0 if summary.groups_ok or not summary.groups_failed else 1
    finally:
        stop.set()
        server.stop()
        engine.shutdown()
        if client is not None:
            client.close()
