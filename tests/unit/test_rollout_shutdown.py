"""`r3flow rollout` exits within a bound after SIGTERM (services/rollout/shutdown.py): threads
left busy by abandoned groups' store calls do not hold the exit, and a stop that overruns its
bound ends the process with one line naming it. Each case runs in a child process (the bound
ends it with os._exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import asyncio, logging, sys, time
    from services.rollout.shutdown import StopDeadline, run_bounded
    logging.basicConfig(level="INFO")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        # The child's sleeps are the hangs under test, not waits: an append that keeps
        # retrying in an executor thread, its group cancelled.
        task = asyncio.ensure_future(loop.run_in_executor(None, time.sleep, 60))
        await asyncio.sleep(0.1)  # its thread has started (a cancel cannot stop it then)
        task.cancel()
        if sys.argv[1] == "overrun":
            StopDeadline(1.0).arm()
            time.sleep(60)  # a stop that hangs in the loop itself
        return 0

    sys.exit(run_bounded(main(), drain_s=1.0))
""")


def _child(mode: str) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          timeout=50)
    return proc.returncode, time.monotonic() - t0, proc.stderr


def test_busy_executor_threads_do_not_hold_the_exit():
    code, took, err = _child("threads")
    assert code == 0, err
    assert took < 20, f"exit took {took:.1f}s (a thread sleeps 60s)"
    assert "still busy" in err


def test_a_stop_that_overruns_its_bound_ends_the_process():
    code, took, err = _child("overrun")
    assert code == 4, err
    assert took < 20 and "overran its bound" in err
