"""Fixtures for the trajectory-store integration tests: a real redis-server and a real
`r3flow store` process on free loopback ports, both stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.net import free_port
from services.common.pb.r3flow.v1 import trajectory_pb2
from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group

REPO = Path(__file__).resolve().parents[2]


STORE_MODULE = [sys.executable, "-m", "services.store.cli"]  # = `r3flow store`, fewer imports
R3FLOW_STORE = [str(Path(sys.executable).parent / "r3flow"), "store"]


class StoreProcess:
    """The store as a child process; `redis_url=None` lets it start its embedded redis."""

    def __init__(self, redis_url: str | None, workdir: Path, env: dict[str, str] | None = None,
                 entry: list[str] = STORE_MODULE, **config: object) -> None:
        self.redis_url = redis_url
        self.entry = entry
        self.env = env or {}
        self.port = free_port()
        self.metrics_port = free_port()
        self.config_path = workdir / f"store-{self.port}.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = workdir / f"store-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> StoreProcess:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("REDIS_URL", None)
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        argv = [*self.entry, "--config", str(self.config_path),
                "--listen", self.address, "--metrics-port", str(self.metrics_port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
        with StoreClient(self.address) as client:
            try:
                client.wait_ready(timeout_s)
            except TimeoutError:
                self.kill()
                log = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"store did not start: {log}") from None
        return self

    def kill(self) -> None:
        """SIGKILL by pid (a crash)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM by pid (graceful), SIGKILL if it hangs."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> StoreProcess:
        self.kill()
        return self.start()


def redis_keys(url: str, prefix: str) -> set[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return set(client.scan_iter(match=prefix + "*", count=1000))
    finally:
        client.close()


@pytest.fixture(scope="module")
def store_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A redis-server with AOF fsync on every write, so even SIGKILL loses nothing."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendfsync="always").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store_process(store_redis: EmbeddedRedis,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    """A store process over `store_redis` with default limits."""
    proc = StoreProcess(store_redis.url, tmp_path_factory.mktemp("store")).start()
    yield proc
    proc.stop()


def crash_group(index: int, size: int = 4) -> list[trajectory_pb2.Trajectory]:
    """Group `index` of the crash test: small trajectories, two segments (a partial rollout)."""
    return small_group(f"crash-{index}", size, seed=index)


def run_appender(address: str, client_index: int, groups: int, batch: int = 1
                 ) -> dict[str, int]:
    """Append member `client_index` of every crash group, retrying through store restarts:
    one Append stream each, or (`batch` > 1) those of `batch` groups in one AppendBatch."""
    accepted = duplicates = 0
    # Patient: a restart on a loaded 2-core machine can take tens of seconds.
    with StoreClient(address, timeout_s=20, max_retries=60, max_backoff_s=1.0) as client:
        for g in range(0, groups, batch):
            trajs = [crash_group(k)[client_index] for k in range(g, min(groups, g + batch))]
            res = client.append_trajectories(trajs) if batch > 1 else \
                client.append_trajectory(trajs[0])
            accepted += res.accepted
            duplicates += res.duplicates
        return {"accepted": accepted, "duplicates": duplicates, "retries": client.retries}


def run_holder(address: str, consumer: str, lease_seconds: int) -> None:
    """Pull one group, print its delivery id, then hang until killed (a crashed trainer)."""
    with StoreClient(address) as client:
        [group] = client.pull(consumer, 1, lease_seconds=lease_seconds, wait_ms=10_000)
        print(group.delivery_id, group.group_id, flush=True)
        time.sleep(3600)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval_s)


if __name__ == "__main__":
    # Child-process entry points: `append ADDRESS CLIENT_INDEX GROUPS BATCH` |
    # `hold ADDRESS CONSUMER LEASE`
    mode, address, *rest = sys.argv[1:]
    if mode == "append":
        print(json.dumps(run_appender(address, *map(int, rest))), flush=True)
    else:
        run_holder(address, rest[0], int(rest[1]))
