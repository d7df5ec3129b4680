"""A rollout worker's registration: renewed from its own thread (a blocked event loop cannot
let it lapse), and a stopping worker stops renewing, then withdraws it
(services/rollout/app.py: Registration / _leave)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from services.rollout.app import Registration, _leave


def _worker(version: int = 7) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(worker_id="w1"),
                           engine=SimpleNamespace(policy_version=version, run_id="run-a"))


class _Client:
    """register_worker blocks for a while, like the RPC; TTL 3 s: a renewal every 1 s."""

    def __init__(self, log: list[str], fail: bool = False, rpc_s: float = 0.3) -> None:
        self.log, self.fail, self.rpc_s = log, fail, rpc_s

    def register_worker(self, worker_id: str, host: str, world_size: int, version: int,
                        run_id: str) -> int:
        assert run_id == "run-a"  # the run whose weights it serves
        time.sleep(self.rpc_s)
        if self.fail:
            raise ConnectionError("store gone")
        self.log.append(f"register {worker_id} v{version}")
        return 3

    def unregister_worker(self, worker_id: str) -> bool:
        if self.fail:
            raise ConnectionError("store gone")
        self.log.append(f"unregister {worker_id} {threading.current_thread().name != 'MainThread'}")
        return True


def test_renewals_go_on_while_the_event_loop_is_blocked():
    log: list[str] = []

    async def run() -> None:
        reg = Registration(_Client(log, rpc_s=0.0), _worker(), 3)
        time.sleep(3.5)  # the loop is stuck (a long engine call): renewals must still happen
        assert len(log) >= 2 and set(log) == {"register w1 v7"}, log
        await _leave(reg, None, "w1")

    asyncio.run(run())


def test_a_renewal_in_flight_lands_before_the_unregister():
    async def run() -> list[str]:
        log: list[str] = []
        reg = Registration(_Client(log), _worker(), 3)
        await asyncio.sleep(1.1)  # the first renewal is now inside its (0.3 s) RPC
        await _leave(reg, _Client(log), "w1")
        await asyncio.sleep(1.2)  # no renewal after leaving
        return log

    assert asyncio.run(run()) == ["register w1 v7", "unregister w1 True"]


def test_renewal_and_unregister_failures_are_not_fatal():
    async def run() -> None:
        reg = Registration(_Client([], fail=True, rpc_s=0.0), _worker(), 3)
        await asyncio.sleep(1.2)  # one failed renewal: logged, the thread goes on
        assert reg._thread.is_alive()
        await _leave(reg, _Client([], fail=True), "w1")
        assert not reg._thread.is_alive()
        await _leave(None, None, "w1")

    asyncio.run(run())
