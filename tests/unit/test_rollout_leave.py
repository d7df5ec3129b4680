"""A stopping rollout worker stops renewing its registration, then withdraws it
(services/rollout/app.py: _keep_registered / _leave)."""

from __future__ import annotations

import asyncio
import threading
import time

from services.rollout.app import _keep_registered, _leave


class _Worker:
    """report_version blocks in a thread for a while, like a RegisterWorker RPC."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def report_version(self) -> int:
        def rpc() -> int:
            time.sleep(0.3)
            self.log.append("register")
            return 3  # TTL 3 s: the next renewal is due after 1 s

        return await asyncio.to_thread(rpc)


class _Client:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def unregister_worker(self, worker_id: str) -> bool:
        if self.fail:
            raise ConnectionError("store gone")
        self.log.append(f"unregister {worker_id} {threading.current_thread().name != 'MainThread'}")
        return True


def test_a_renewal_in_flight_lands_before_the_unregister():
    async def run() -> list[str]:
        log: list[str] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_keep_registered(_Worker(log), 1, stop))
        await asyncio.sleep(1.1)  # the first renewal is now inside its (0.3 s) RPC
        await _leave((task, stop), _Client(log), "w1")
        await asyncio.sleep(1.2)  # no renewal after leaving
        return log

    assert asyncio.run(run()) == ["register", "unregister w1 True"]


def test_unregister_failure_is_not_fatal():
    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(_keep_registered(_Worker([]), 0, stop))  # no TTL: no renewal
        await _leave((task, stop), _Client([], fail=True), "w1")
        await _leave(None, None, "w1")

    asyncio.run(run())
