"""A rollout worker's registration: renewed from its own thread (a blocked event loop cannot
let it lapse), and a stopping worker stops renewing, then withdraws it
(services/rollout/app.py: Registration / _leave)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from services.rollout.app import Registration, _leave


def _worker(version: int = 7) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(worker_id="w1"),
                           engine=SimpleNamespace(policy_version=version, run_id="run-a",
                                                  device_uuid="GPU-0"))


class _Client:
    """A store client whose register_worker (TTL 3 s: a renewal every 1 s) reports each call:
    `calling` is set as a call starts, `renewed` once `want` calls succeeded; with `gate` a
    call blocks, like an RPC in flight, until `gate` is set."""

    def __init__(self, log: list[str], fail: bool = False, want: int = 1,
                 gate: threading.Event | None = None) -> None:
        self.log, self.fail, self.want, self.gate = log, fail, want, gate
        self.calls = 0
        self.calling, self.renewed = threading.Event(), threading.Event()

    def register_worker(self, worker_id: str, host: str, world_size: int, version: int,
                        device_uuid: str, run_id: str) -> int:
        # the run whose weights it serves, and its engine's GPU (the push picks CUDA IPC by it)
        assert (run_id, device_uuid) == ("run-a", "GPU-0")
        self.calls += 1
        self.calling.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never let the RPC finish"
        if self.fail:
            raise ConnectionError("store gone")
        self.log.append(f"register {worker_id} v{version}")
        if len(self.log) >= self.want:
            self.renewed.set()
        return 3

    def unregister_worker(self, worker_id: str) -> bool:
        if self.fail:
            raise ConnectionError("store gone")
        self.log.append(f"unregister {worker_id} {threading.current_thread().name != 'MainThread'}")
        return True


def test_renewals_go_on_while_the_event_loop_is_blocked():
    log: list[str] = []

    async def run() -> None:
        client = _Client(log, want=2)
        reg = Registration(client, _worker(), 3)
        # The loop is stuck (a blocking wait, as a long engine call): renewals must still happen.
        assert client.renewed.wait(10), log
        assert set(log) == {"register w1 v7"}, log
        await _leave(reg, None, "w1")

    asyncio.run(run())


def test_a_renewal_in_flight_lands_before_the_unregister():
    async def run() -> tuple[list[str], Registration]:
        log: list[str] = []
        gate = threading.Event()
        client = _Client(log, gate=gate)
        reg = Registration(client, _worker(), 3)
        assert await asyncio.to_thread(client.calling.wait, 10)  # a renewal is in its RPC
        leaving = asyncio.create_task(_leave(reg, _Client(log), "w1"))
        assert await asyncio.to_thread(reg._stop.wait, 10)  # _leave stopped the renewals...
        gate.set()  # ... and waits for the one in flight before it unregisters
        await leaving
        return log, reg

    log, reg = asyncio.run(run())
    assert log == ["register w1 v7", "unregister w1 True"]
    assert not reg._thread.is_alive()  # no renewal after leaving: the thread has ended


def test_renewal_and_unregister_failures_are_not_fatal():
    async def run() -> None:
        client = _Client([], fail=True)
        reg = Registration(client, _worker(), 3)
        assert await asyncio.to_thread(client.calling.wait, 10)
        client.calling.clear()
        # a second attempt: the thread logged the first failure and went on
        assert await asyncio.to_thread(client.calling.wait, 10) and client.calls >= 2
        assert reg._thread.is_alive()
        await _leave(reg, _Client([], fail=True), "w1")
        assert not reg._thread.is_alive()
        await _leave(None, None, "w1")

    asyncio.run(run())
