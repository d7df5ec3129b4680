"""gRPC TrajectoryStore servicer (thin: proto <-> core) and the server that hosts it.

Errors: ValueError -> INVALID_ARGUMENT; CapacityError (backlog, in-flight, Redis full at its
maxmemory) -> RESOURCE_EXHAUSTED with a `retry-after-ms` trailer; SizeLimitError -> RESOURCE_EXHAUSTED (no hint); Redis unreachable -> UNAVAILABLE (clients retry); a group released
while PullChunks sent it -> ABORTED (clients pull again); anything else ->
INTERNAL with a log line. grpc.health.v1 reports NOT_SERVING while Redis is unreachable.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import (
    RoleTokenInterceptor,
    describe,
    fingerprint,
    load_tokens,
    server_credentials,
)
from services.common.errors import one_line
from services.common.pb.r3flow.v1 import store_pb2, store_pb2_grpc
from services.store.config import StoreConfig
from services.store.control import ControlPlane
from services.store.core import StatsSnapshot, TrajectoryStoreCore
from services.store.errors import (
    CapacityError,
    ChunkMissing,
    SizeLimitError,
    StreamCutShort,
    is_redis_oom,
)
from services.store.handlers import SERVICE_NAME, add_servicer
from services.store.wire_metadata import APPEND_MESSAGES_KEY, REFUSAL_REASON_KEY, RETRY_AFTER_KEY

log = logging.getLogger(__name__)

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
WATCH_POLL_S = 0.5  # watchers re-read Redis this often (versions published by other replicas)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, SizeLimitError):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, CapacityError):
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(exc.retry_after_ms)),
                                       (REFUSAL_REASON_KEY, exc.reason)))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, StreamCutShort):
        context.abort(grpc.StatusCode.CANCELLED, str(exc))
    if isinstance(exc, ChunkMissing):
        context.abort(grpc.StatusCode.ABORTED, str(exc))
    if isinstance(exc, _REDIS_DOWN):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"redis unavailable: {exc}")
    if context.is_active():
        log.error("internal error in %s", context.peer(), exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _declared_messages(context: grpc.ServicerContext) -> int | None:
    """The message count an Append stream's client declared; None when it declared none (a
    client older than the key: its stream is checked only as well as gRPC reports a cut)."""
    value = dict(context.invocation_metadata() or ()).get(APPEND_MESSAGES_KEY)
    if value is None:
        return None
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{APPEND_MESSAGES_KEY}: not a message count: {value!r}")
    return count


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 (mapped to a status code, never swallowed)
            _abort(context, self.core.redis_full(fn.__name__, e) if is_redis_oom(e) else e)
    return wrapper


def _streaming(fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except Exception as e:  # noqa: BLE001
            _abort(context, self.core.redis_full(fn.__name__, e) if is_redis_oom(e) else e)
    return wrapper


class TrajectoryStoreServicer(store_pb2_grpc.TrajectoryStoreServicer):
    """Translates proto <-> core calls; no store logic here."""

    def __init__(self, core: TrajectoryStoreCore, control: ControlPlane,
                 stop: threading.Event) -> None:
        self.core = core
        self.control = control
        self.stop = stop

    @_unary
    def Append(self, request_iterator, context):  # noqa: N802 (gRPC method names)
        declared = _declared_messages(context)
        requests = list(request_iterator)

        def check_whole() -> None:
            # The stream broke off (an oversized message, a cancelled client): gRPC may end the
            # iterator quietly and report the cancellation a moment later, so this is checked
            # again right before the commit; a truncated stream must not be committed. The
            # count the client declared (APPEND_MESSAGES_KEY) tells it for certain.
            if declared is not None and len(requests) != declared:
                raise StreamCutShort(f"stream: {len(requests)} messages arrived of the "
                                     f"{declared} its client declared ({APPEND_MESSAGES_KEY}); "
                                     "nothing committed")
            if not context.is_active():
                raise StreamCutShort("stream: ended before the client closed it")
        check_whole()
        res = self.core.append(requests, before_commit=check_whole)
        return store_pb2.AppendResponse(accepted=res.accepted, duplicates=res.duplicates,
                                        policy_version=res.policy_version)

    @_unary
    def AppendBatch(self, request, context):  # noqa: N802
        # One message: it arrived whole (no truncated stream to guard against).
        res = self.core.append(request.requests)
        return store_pb2.AppendResponse(accepted=res.accepted, duplicates=res.duplicates,
                                        policy_version=res.policy_version)

    @_streaming
    def Pull(self, request, context):  # noqa: N802
        # Serialized PulledGroup bytes: registered with an identity serializer (add_servicer).
        for d in self.core.pull(request.consumer, request.max_groups, request.lease_seconds,
                                request.wait_ms, request.session):
            yield d.to_bytes()

    @_streaming
    def PullChunks(self, request, context):  # noqa: N802
        # Serialized PulledPart bytes, one routing chunk at most each (add_servicer).
        for d in self.core.pull(request.consumer, request.max_groups, request.lease_seconds,
                                request.wait_ms, request.session):
            yield from d.parts()

    @_unary
    def Ack(self, request, context):  # noqa: N802
        if not request.consumer:
            raise ValueError("consumer: required")
        acked = self.core.ack(request.consumer, request.delivery_ids)
        acked += sum(self.core.drop(request.consumer, d.delivery_id, d.reason, d.trajectories)
                     for d in request.dropped)
        return store_pb2.AckResponse(acked=acked)

    @_unary
    def PublishPolicyVersion(self, request, context):  # noqa: N802
        if not request.run_id:
            return store_pb2.PolicyVersion(
                version=self.core.publish_policy_version(request.version))
        run = self.core.start_run(request.run_id, request.version)
        return store_pb2.PolicyVersion(version=self.core.policy_version(), run_id=run.run_id,
                                       run_start_version=run.start_version)

    @_streaming
    def WatchPolicyVersion(self, request, context):  # noqa: N802
        # the first answer is at once: a reconnecting watcher learns trainer_gone either way
        known, gone_sent = request.known_version, None
        while context.is_active() and not self.stop.is_set():
            version, gone = self.core.policy_version(), self.control.trainer_gone()
            if version > known or gone != gone_sent:
                known, gone_sent = max(known, version), gone
                yield store_pb2.PolicyVersion(version=version, trainer_gone=gone)
            else:
                self._wait_for_change()

    @_unary
    def GetStats(self, request, context):  # noqa: N802
        stats = stats_to_proto(self.core.stats(), self.core.cfg.max_groups_ahead or 0)
        stats.trainer_gone = self.control.trainer_gone()
        return stats

    @_unary
    def TrainerHeartbeat(self, request, context):  # noqa: N802
        ttl = self.control.trainer_heartbeat(request)
        with self.core.version_changed:  # watchers learn at once that it left
            self.core.version_changed.notify_all()
        return store_pb2.TrainerPresenceResponse(ttl_seconds=ttl)

    @_unary
    def RegisterWorker(self, request, context):  # noqa: N802
        return store_pb2.RegisterWorkerResponse(ttl_seconds=self.control.register_worker(request))

    @_unary
    def UnregisterWorker(self, request, context):  # noqa: N802
        return store_pb2.UnregisterWorkerResponse(
            was_registered=self.control.unregister_worker(request.worker_id))

    @_unary
    def ListWorkers(self, request, context):  # noqa: N802
        return store_pb2.WorkerList(workers=self.control.list_workers())

    @_unary
    def PublishWeightSync(self, request, context):  # noqa: N802
        self.control.publish_weight_sync(request)
        with self.core.version_changed:
            self.core.version_changed.notify_all()
        return store_pb2.Empty()

    @_streaming
    def WatchWeightSync(self, request, context):  # noqa: N802
        known = request.known_version
        while context.is_active() and not self.stop.is_set():
            plan = self.control.latest_weight_sync()
            if plan is not None and plan.version > known:
                known = plan.version
                yield plan
            else:
                self._wait_for_change()

    def _wait_for_change(self) -> None:
        with self.core.version_changed:
            self.core.version_changed.wait(WATCH_POLL_S)


def stats_to_proto(s: StatsSnapshot, max_groups_ahead: int = 0) -> store_pb2.StoreStats:
    c = s.counters
    return store_pb2.StoreStats(
        trajectories_appended=c.get("trajectories_appended", 0),
        trajectories_complete=c.get("trajectories_complete", 0),
        groups_ready=s.groups_ready, groups_delivered=c.get("groups_delivered", 0),
        groups_acked=c.get("groups_acked", 0), backlog_tokens=max(0, c.get("backlog_tokens", 0)),
        dropped_stale=c.get("dropped:stale", 0), redeliveries=c.get("redeliveries", 0),
        policy_version=s.policy_version, dropped_by_reason=s.dropped_by_reason(),
        groups_leased=s.groups_pending, groups_open=s.groups_open,
        max_groups_ahead=max_groups_ahead,
        groups_dead_lettered=c.get("groups_dead_lettered", 0),
        run_id=s.run.run_id if s.run else "", run_start_version=s.run.start_version if s.run else 0)


def _interceptors(config: StoreConfig) -> list[grpc.ServerInterceptor]:
    if not config.auth.token_files:
        return []
    tokens = load_tokens(config.auth)
    log.info("role tokens: %s", ", ".join(f"{r}={fingerprint(t)}" for r, t in tokens.items()))
    return [RoleTokenInterceptor(tokens)]


def transport_cap(max_message_bytes: int) -> int:
    return min(2**31 - 1, 4 * max_message_bytes + (1 << 20))


class StoreServer:
    """The gRPC server, its health service and the maintenance thread (timeouts, gauges)."""

    def __init__(self, config: StoreConfig, core: TrajectoryStoreCore,
                 on_fatal: Callable[[], None] = lambda: None) -> None:
        """`on_fatal` is called (from the maintenance thread) once a background duty failed
        in a way it does not expect; `fatal` then holds the cause in one line."""
        self.cfg = config
        self.core = core
        self.redis_ok = False
        self.fatal: str | None = None
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self.health = health.HealthServicer()
        interceptors = _interceptors(config)
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(config.grpc_workers, thread_name_prefix="store-rpc"),
            interceptors=interceptors, options=[
                # The store enforces max_message_bytes itself: when gRPC refuses an oversized
                # message it may end the request stream as if the client had closed it, and the
                # truncated stream would be committed. The transport cap is a last resort.
                ("grpc.max_receive_message_length", transport_cap(config.max_message_bytes)),
                ("grpc.max_send_message_length", config.max_pull_message_bytes)])
        control = ControlPlane(core.r, core.keys, config.worker_ttl_seconds,
                               config.trainer_ttl_seconds)
        add_servicer(TrajectoryStoreServicer(core, control, self._stop), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.grpc)
        self.port = (self.grpc.add_secure_port(config.listen, server_credentials(config.auth))
                     if config.auth.tls else self.grpc.add_insecure_port(config.listen))
        if self.port == 0:
            raise ValueError(f"listen: cannot bind {config.listen}")
        self._thread = threading.Thread(target=self._maintain, name="store-maint", daemon=True)

    def start(self) -> StoreServer:
        self._check_redis()
        self.grpc.start()
        self._thread.start()
        log.info("TrajectoryStore listening on %s (port %d)", self.cfg.listen, self.port)
        line = describe(self.cfg.auth, self.cfg.listen)
        (log.warning if line.startswith("INSECURE") else log.info)("%s", line)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.grpc.stop(grace_s).wait()

    def wait(self) -> None:
        self.grpc.wait_for_termination()

    def _check_redis(self) -> None:
        try:
            self.core.r.ping()
            self.core.stats()  # refreshes the gauges
            ok = True
        except _REDIS_DOWN as e:
            if self.redis_ok:
                log.warning("redis unreachable: %s", e)
            ok = False
        status = health_pb2.HealthCheckResponse.SERVING if ok else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
        self.redis_ok = ok

    def _maintain(self) -> None:
        """The background duties; an error none of them expects ends the store (`on_fatal`):
        serving on without health updates or group timeouts would hide it."""
        try:
            self._maintain_loop()
        except Exception as e:  # noqa: BLE001 (reported in one line, then the store stops)
            self.fatal = f"store maintenance failed: {type(e).__name__}: {one_line(str(e))}"
            log.critical("%s", self.fatal)
            for name in ("", SERVICE_NAME):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._on_fatal()

    def _maintain_loop(self) -> None:
        last_reap = 0.0
        tick_s = min(1.0, self.cfg.reaper_interval_seconds)
        while not self._stop.wait(tick_s):
            self._check_redis()
            if not self.redis_ok or time.monotonic() - last_reap < self.cfg.reaper_interval_seconds:
                continue
            last_reap = time.monotonic()
            try:
                self.core.reap_timeouts()
            except _REDIS_DOWN as e:
                log.warning("group timeout check skipped: %s", e)
