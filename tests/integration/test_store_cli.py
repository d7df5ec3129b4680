"""`r3flow store` with no REDIS_URL: it runs its own redis-server (AOF on) and stops it with
itself; data survives a store restart; a SIGKILLed store does not leave redis orphaned."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from store_fixtures import R3FLOW_STORE, StoreProcess, wait_until

from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_embedded_redis_lifecycle(tmp_path: Path) -> None:
    data = tmp_path / "redis-data"
    store = StoreProcess(None, tmp_path, entry=R3FLOW_STORE,
                         redis={"data_dir": str(data), "appendfsync": "always"}).start()
    client = StoreClient(store.address)
    for traj in small_group("cli", 2):
        client.append_trajectory(traj)
    [group] = client.pull("t", 1, wait_ms=1000)
    assert client.ack("t", [group.delivery_id]) == 1
    assert store.proc is not None
    [redis_pid] = _children(store.proc.pid)

    store.proc.send_signal(signal.SIGTERM)  # graceful: stops its redis too
    assert store.proc.wait(20) == 0
    wait_until(lambda: not _alive(redis_pid), 10, "embedded redis to stop")
    assert (data / "appendonly.aof").stat().st_size > 0

    store.start()  # same data dir: the AOF brings the counters back
    assert client.stats().groups_acked == 1
    [redis_pid] = _children(store.proc.pid)
    store.kill()   # SIGKILL: the redis child gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
    wait_until(lambda: not _alive(redis_pid), 10, "orphaned redis to exit")
    assert not _alive(redis_pid) and os.path.exists(data / "redis.log")


@pytest.mark.timeout(60)
def test_a_failed_background_duty_ends_the_store_with_its_cause(tmp_path: Path) -> None:
    """An error the maintenance thread does not expect (here: the open-groups index
    overwritten in Redis, WRONGTYPE) ends `r3flow store` with exit code 1 and the cause on one
    line, instead of serving on with frozen health and no group timeouts."""
    import redis

    with EmbeddedRedis(tmp_path / "redis") as server:
        store = StoreProcess(server.url, tmp_path, key_prefix="dutyfail:",
                             reaper_interval_seconds=0.05).start()
        assert store.proc is not None
        try:
            redis.Redis.from_url(server.url).set("dutyfail:open", "not a sorted set")
            assert store.proc.wait(20) == 1
        finally:
            store.kill()
        lines = [ln for ln in store.log_path.read_text().splitlines()
                 if "store maintenance failed:" in ln]
        assert len(lines) == 1, lines
