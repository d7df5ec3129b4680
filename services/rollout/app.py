"""Process wiring of `r3flow rollout`: metrics server, engine, dataset, store, worker, and the
background duties (registration renewal, trainer-version watch, weight-sync pushes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from services.common.metrics import MetricsServer, create_metrics
from services.rollout.capture_check import RoutingCaptureError, check_capture
from services.rollout.config import RolloutConfig
from services.rollout.engine import EngineDead
from services.rollout.shutdown import SHUTDOWN_S, StopDeadline

log = logging.getLogger(__name__)

EXIT_FATAL = 3  # the engine died (or another error no later group can avoid)
# Then vLLM kills what is left of its processes. Its EngineCore waits 5 s (vLLM's default) for
# its worker processes to leave after the death pipe closes, and on vLLM-CPU they never do in
# time: each stop spent the whole 5 s then; the engine keeps no state worth a longer wait.
ENGINE_SHUTDOWN_S = 2.0
UNREGISTER_S = 5.0  # withdrawing the registration at exit (the store may be gone)


def _watch_trainer_version(client: Any, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Thread body: mirror the store's published policy version and trainer presence into
    `worker` (`gate.trainer_state`)."""
    for msg in client.watch_policy_version(-1):
        loop.call_soon_threadsafe(worker.gate.trainer_state, msg.version, msg.trainer_gone)


def _watch_weight_sync(client: Any, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Thread body: apply each weight-sync plan that names this worker, one at a time."""
    for plan in client.watch_weight_sync(worker.cfg.worker_id, worker.engine.policy_version):
        fut = asyncio.run_coroutine_threadsafe(worker.apply_weight_sync(plan), loop)
        try:
            fut.result()
        except concurrent.futures.CancelledError:  # the worker is shutting down
            return
        except EngineDead as e:  # the worker stops on its own; nothing more to receive
            log.error("weight sync v%d not applied: engine dead: %s", plan.version, e)
            return
        except Exception:  # a failed push leaves the old weights serving: log, keep watching
            log.exception("weight sync v%d failed", plan.version)


class Registration:
    """Renews this worker's RegisterWorker entry (it carries the served policy version) well
    inside its TTL from a thread of its own: a busy event loop or a full default executor
    (appends, engine calls) can then never let it lapse, which would leave this worker out of
    the trainer's next weight-sync plan."""

    def __init__(self, client: Any, worker: Any, ttl_s: int) -> None:
        self.client, self.worker, self.ttl_s = client, worker, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registration", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from services.rollout.report import RepeatedLog

        failures = RepeatedLog(log)
        while not self._stop.wait(max(1.0, self.ttl_s / 3)):
            try:
                self.ttl_s = self.client.register_worker(
                    self.worker.cfg.worker_id, socket.gethostname(), 1,
                    self.worker.engine.policy_version, self.worker.engine.device_uuid or "",
                    self.worker.engine.run_id)
            except Exception as e:  # noqa: BLE001 (the store may be restarting: retry)
                failures.error(f"registration renewal failed: {e}")

    def stop(self) -> None:
        """Stop renewing; a renewal in flight completes first (it would re-register us)."""
        self._stop.set()
        self._thread.join()


async def _leave(renewal: Registration | None, client: Any, worker_id: str) -> None:
    """Stop renewing, then withdraw the registration, so the trainer's next weight-sync plan
    leaves this worker out at once (a dead one drops out when its TTL runs out). Best effort:
    the store may be gone already."""
    if renewal is not None:
        await asyncio.to_thread(renewal.stop)
    if client is None:
        return
    try:  # its own thread: the executor's may all be busy with abandoned groups' appends
        await asyncio.wait_for(_in_own_thread(client.unregister_worker, worker_id), UNREGISTER_S)
    except Exception as e:  # noqa: BLE001 (shutting down: log and go on)
        log.warning("could not unregister %s from the store: %s", worker_id, e)


async def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a daemon thread of its own (never queued behind the default executor)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def body() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting task)
            fut.set_exception(e)
    threading.Thread(target=body, name=getattr(fn, "__name__", "call"), daemon=True).start()
    return await asyncio.wrap_future(fut)


def _open_store(cfg: RolloutConfig) -> Any:
    from services.common.auth import ClientAuth
    from services.store.client import StoreClient

    assert cfg.store is not None
    client = StoreClient(cfg.store, timeout_s=cfg.store_timeout_s,
                         max_retries=cfg.store_max_retries,
                         auth=ClientAuth.from_config(cfg.store_auth))
    client.wait_ready(cfg.store_timeout_s)
    return client


def _guarded(target: Any, closing: threading.Event, client: Any, worker: Any,
             loop: asyncio.AbstractEventLoop) -> None:
    """Thread body wrapper: a watch ends with the process (closed channel, closed loop);
    one that raises before (the store gone past the client's retries, a bug) stops the worker
    fatal, naming the cause: it would otherwise serve on without weight updates."""
    try:
        target(client, worker, loop)
        return  # the worker is stopping (its engine died, or it was cancelled)
    except Exception as e:  # noqa: BLE001 (handed to the worker below)
        detail = e.details() if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]
        cause = f"{type(e).__name__}: {detail}"
    if closing.is_set():
        log.info("%s stopped: %s", target.__name__, cause)
        return
    try:
        loop.call_soon_threadsafe(worker.fail, f"{target.__name__} stopped: {cause}")
    except RuntimeError:  # the loop closed meanwhile: the process is ending anyway
        log.info("%s stopped: %s", target.__name__, cause)


def _start_watchers(cfg: RolloutConfig, client: Any, worker: Any,
                    closing: threading.Event) -> None:
    loop = asyncio.get_running_loop()
    watchers = [_watch_weight_sync]
    if cfg.max_policy_lag is not None:
        watchers.append(_watch_trainer_version)
    for target in watchers:  # daemon threads: they block in server streams until exit
        threading.Thread(target=_guarded, name=target.__name__, daemon=True,
                         args=(target, closing, client, worker, loop)).start()


def _summary_writer(path: str | None, worker_id: str, engine_pids: dict[str, list[int]]
                    ) -> Callable[..., None]:
    """Writes the worker's summary to `path` atomically (a reader never sees half a file), so
    even a SIGKILLed worker leaves its last progress: groups started, sent, failed, abandoned.
    It also names the engine's processes (engine core, workers) by pid."""
    def write(summary: Any, final: bool = False) -> None:
        if path is None:
            return
        data = {**asdict(summary), "groups_in_flight": summary.groups_in_flight,
                "worker_id": worker_id, "pid": os.getpid(), "engine_pids": engine_pids,
                "final": final}
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, target)
    return write


async def _capture_ok(worker: Any, rec: Any) -> bool:
    """The start check of the engine's routing capture (services/rollout/capture_check.py),
    before this worker registers: False (logged, one line naming the setting) when it fails.
    Once it passed, its prompt is the one the check after each weight load generates."""
    cfg = worker.cfg
    try:
        probe_ids = worker.prompts.render(rec).token_ids
        await check_capture(worker.engine, cfg.sampling, probe_ids, cfg.engine.seed,
                            cfg.partial_rollout_policy)
    except RoutingCaptureError as e:
        log.critical("rollout %s refuses to serve: %s", cfg.worker_id, e)
        return False
    except ValueError as e:  # the probe prompt itself is bad (its group would fail alone)
        log.warning("routing capture start check skipped: %s", e)
        return True
    log.info("routing capture start check passed")
    worker.capture_check.probe_ids = probe_ids  # the same check after each weight load
    return True


def _stop_on_sigterm(worker: Any, stop_grace_s: float) -> None:
    """SIGTERM: no new prompt (in-flight groups get the stop grace), and the whole stop bounded
    by a deadline that ends the process (services/rollout/shutdown.py)."""
    deadline = StopDeadline(stop_grace_s + SHUTDOWN_S)

    def on_sigterm() -> None:
        worker.request_stop()
        deadline.arm()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)


async def serve(cfg: RolloutConfig, summary_file: str | None = None,
                stop_grace_s: float = 30.0) -> int:
    """Run the worker to the end of its dataset, or until SIGTERM (then in-flight groups get
    `stop_grace_s` to finish and be sent); writes `summary_file`; returns the exit code."""
    from transformers import AutoTokenizer

    from services.rollout.agent import load_environment_factory
    from services.rollout.dataset import load_dataset
    from services.rollout.engine import RolloutEngine
    from services.rollout.sink import StoreSink
    from services.rollout.worker import RolloutWorker

    records = load_dataset(cfg.dataset, cfg.prompts)
    env_factory = load_environment_factory(cfg.environment)
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "rollout")
    client = _open_store(cfg) if cfg.store else None
    engine = RolloutEngine.start(cfg.engine, metrics)
    server = MetricsServer(registry, cfg.metrics_host, cfg.metrics_port,
                           health_fn=lambda: engine.dead_reason() is None).start()
    log.info("rollout metrics on %s", server.url)
    sink = StoreSink(client, cfg.backpressure_sleep_s) if client is not None else None
    renewal: Registration | None = None
    closing = threading.Event()  # set once run() returned: the watches end with the process
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.engine.model)
        worker = RolloutWorker(cfg, engine, sink, tokenizer, env_factory)
        write_summary = _summary_writer(summary_file, cfg.worker_id, engine.pids)
        worker.on_progress = write_summary
        if not await _capture_ok(worker, records[0]):
            return EXIT_FATAL
        _stop_on_sigterm(worker, stop_grace_s)
        ttl_s = await worker.report_version()
        if client is not None and ttl_s:
            renewal = Registration(client, worker, ttl_s)
        if client is not None:
            _start_watchers(cfg, client, worker, closing)
        summary = await worker.run(records, stop_grace_s)
        closing.set()
        write_summary(summary, True)
        if summary.fatal:
            log.critical("rollout %s failed: %s (%d groups ok, %d abandoned)", cfg.worker_id,
                         summary.fatal, summary.groups_ok, summary.groups_abandoned)
            return EXIT_FATAL
        log.info("rollout done%s: %d groups ok, %d failed, %d abandoned, %d tokens in %.1fs "
                 "(%.1f tok/s)", " (stopped)" if summary.stopped_early else "",
                 summary.groups_ok, summary.groups_failed, summary.groups_abandoned,
                 summary.generated_tokens, summary.seconds,
                 summary.generated_tokens / max(summary.seconds, 1e-9))
        return 0 if summary.groups_ok or not summary.groups_failed else 1
    finally:
        closing.set()  # also when run() raised: closing the client ends the watches
        await _leave(renewal, client, cfg.worker_id)
        server.stop()
        engine.shutdown(ENGINE_SHUTDOWN_S)
        if client is not None:
            client.close()
