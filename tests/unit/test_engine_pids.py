"""The rollout engine's liveness watch: torch.compile's compile workers (children of the engine
core that exit on their own when idle) are not watched as engine workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

from services.rollout.engine import engine_pids

SPAWN = """
import subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
subprocess.Popen(sleep + ["torch._inductor.compile_worker"])  # a compile-pool look-alike
subprocess.Popen(sleep)  # a worker
time.sleep(60)
"""


def test_compile_workers_are_not_watched_as_engine_workers():
    core = subprocess.Popen([sys.executable, "-c", SPAWN], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(psutil.Process(core.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        kids = psutil.Process(core.pid).children()
        assert len(kids) == 2
        llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
            engine_manager=SimpleNamespace(processes=[SimpleNamespace(pid=core.pid)]))))
        pids = engine_pids(llm)
        worker = [k.pid for k in kids if "compile_worker" not in " ".join(k.cmdline())]
        assert pids == {"engine_core": [core.pid], "worker": worker}
    finally:
        os.killpg(core.pid, signal.SIGKILL)  # the process group this test started
        core.wait(timeout=10)
