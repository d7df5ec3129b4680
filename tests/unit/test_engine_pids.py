"""The rollout engine's liveness watch: torch.compile's compile workers (children of the engine
core that exit on their own when idle) are not watched as engine workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import psutil

from services.rollout.engine import engine_pids

# The engine-core look-alike: a compile-pool look-alike and a worker, each (and the core) blocked
# reading stdin until the test closes it; "spawned" once both exist.
SPAWN = """
import subprocess, sys
wait = [sys.executable, "-c", "import sys; sys.stdin.read()"]
subprocess.Popen(wait + ["torch._inductor.compile_worker"])  # a compile-pool look-alike
subprocess.Popen(wait)  # a worker
print("spawned", flush=True)
sys.stdin.read()
"""


def test_compile_workers_are_not_watched_as_engine_workers():
    core = subprocess.Popen([sys.executable, "-c", SPAWN], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert core.stdout.readline() == "spawned\n"
        kids = psutil.Process(core.pid).children()
        assert len(kids) == 2
        llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
            engine_manager=SimpleNamespace(processes=[SimpleNamespace(pid=core.pid)]))))
        pids = engine_pids(llm)
        worker = [k.pid for k in kids if "compile_worker" not in " ".join(k.cmdline())]
        assert pids == {"engine_core": [core.pid], "worker": worker}
    finally:
        core.stdin.close()  # EOF: the core and both children return
        core.wait(timeout=10)
        try:
            os.killpg(core.pid, signal.SIGKILL)  # the process group this test started, if left
        except ProcessLookupError:
            pass
