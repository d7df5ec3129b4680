"""Bounded exit of `r3flow rollout` after SIGTERM, well inside a pod's
terminationGracePeriodSeconds.

The worker's own stop (no new prompt, in-flight groups finished within the stop grace or
abandoned with accounting, final summary, registration withdrawn, engine shut down) is
`RolloutWorker.run` + `serve`. What could still hold the process afterwards are threads: a
cancelled group's store append keeps running in the default executor (the client retries
backpressure), and asyncio.run, then the interpreter, join those threads without a limit. Here
the loop's executor gets `EXECUTOR_DRAIN_S`, and a watchdog armed at SIGTERM ends the process
(exit code EXIT_STOP_OVERRAN, one line naming the bound) if the whole stop overruns
stop grace + SHUTDOWN_S.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

SHUTDOWN_S = 20.0  # after the stop grace: summary, unregister, engine shutdown, threads
EXECUTOR_DRAIN_S = 3.0  # executor threads (abandoned appends) allowed to finish at exit
EXIT_STOP_OVERRAN = 4


def hard_exit(code: int) -> None:
    """Flush what the process wrote and leave now (threads are not joined)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StopDeadline:
    """Armed at SIGTERM: ends the process if it is still running `bound_s` later."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._armed = threading.Event()

    def arm(self) -> None:
        if self._armed.is_set():
            return
        self._armed.set()
        threading.Thread(target=self._watch, name="stop-deadline", daemon=True).start()

    def _watch(self) -> None:
        if not threading.Event().wait(self.bound_s):
            log.critical("rollout stop overran its bound of %.0fs after SIGTERM (stop grace + "
                         "SHUTDOWN_S): exiting now", self.bound_s)
            hard_exit(EXIT_STOP_OVERRAN)


def run_bounded(main: Coroutine[Any, Any, int], drain_s: float = EXECUTOR_DRAIN_S) -> int:
    """asyncio.run(main) whose exit waits at most `drain_s` for executor threads; threads still
    busy then are left behind (the process exits without joining them)."""
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="rollout-io")
    loop.set_default_executor(executor)
    try:
        code = loop.run_until_complete(main)
        _cancel_tasks(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()  # shuts the executor down without waiting
    busy = _drain(executor, drain_s)
    if busy:
        log.warning("%d executor thread(s) still busy %.0fs after the worker stopped (store "
                    "calls of abandoned groups): exiting without them", busy, drain_s)
        hard_exit(code)
    return code


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _drain(executor: concurrent.futures.ThreadPoolExecutor, drain_s: float) -> int:
    """Wait up to `drain_s` for the executor's threads; the number still alive."""
    threads = list(executor._threads)  # noqa: SLF001 (no public handle on them)
    end = time.monotonic() + drain_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return sum(t.is_alive() for t in threads)
