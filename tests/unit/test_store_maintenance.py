"""The store's maintenance thread (health, group timeouts) never dies silently: an error it
does not expect is reported in one line, health turns NOT_SERVING and `on_fatal` ends the store
(`r3flow store` then exits 1). Real store (gRPC in this process, embedded Redis); the error is
provoked in Redis itself: the open-groups index overwritten with a string (WRONGTYPE)."""

from __future__ import annotations

import logging
import threading
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.redis_server import EmbeddedRedis
from services.store.server import StoreServer


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_unexpected_maintenance_error_ends_the_store(tmp_path, caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    with EmbeddedRedis(tmp_path / "redis") as server:
        cfg = StoreConfig(listen="127.0.0.1:0", key_prefix=f"p{uuid.uuid4().hex[:6]}:",
                          reaper_interval_seconds=0.05)
        r = redis.Redis.from_url(server.url)
        core = TrajectoryStoreCore(r, cfg)
        failed = threading.Event()
        srv = StoreServer(cfg, core, on_fatal=failed.set).start()
        try:
            assert _health(srv.port) == health_pb2.HealthCheckResponse.SERVING
            assert srv.fatal is None
            with caplog.at_level(logging.CRITICAL, logger="services.store.server"):
                r.set(core.keys.open_groups, "not a sorted set")
                assert failed.wait(10), "the maintenance thread did not report the error"
            assert srv.fatal is not None and "\n" not in srv.fatal
            assert srv.fatal.startswith("store maintenance failed:")
            assert [rec.getMessage() for rec in caplog.records
                    if rec.levelno == logging.CRITICAL] == [srv.fatal]
            assert _health(srv.port) == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            srv.stop(0)
