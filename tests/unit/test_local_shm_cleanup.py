"""`r3flow local` kills what is left of a child's process group (services/local/procs.py):
the shared-memory files its processes mapped are unlinked too. vLLM's engine maps two
message-queue ring buffers in /dev/shm (160 and 240 MiB on CPU); killed with its resource
tracker, nothing else removes them (seen: 14 of them, 2.9 GiB of tmpfs, after a day of test
runs on one machine)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.local.procs import Child, Supervisor, group_shm

HOLDER = """
import os, signal
from multiprocessing import shared_memory
from services.rollout.vllm_compat import CUTS_PREFIX
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # has to be killed, as a hung engine is
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
cuts = f"/dev/shm/{CUTS_PREFIX}{os.getpid()}-test"  # as CutFiles names its directory
os.makedirs(cuts)
open(os.path.join(cuts, "a.npy"), "wb").close()
print(seg.name, cuts, flush=True)
signal.pause()  # until killed
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_killed_group_leaves_no_shared_memory_behind(tmp_path: Path):
    sup = Supervisor(tmp_path)
    child = Child("holder", [sys.executable, "-c", HOLDER], tmp_path / "holder.log")
    sup._spawn(child)
    sup.children.append(child)
    try:
        deadline = time.monotonic() + 60
        while not child.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        name, cuts = child.log_path.read_text().split()[:2]
        path = f"/dev/shm/{name}"
        assert os.path.exists(path) and os.path.isdir(cuts)
        assert {path, cuts} <= group_shm(child.pid)  # the group's own mappings and pids
        seconds, killed = sup.stop(child, timeout_s=0.5)
        assert killed  # it ignored SIGTERM
        assert not os.path.exists(path), f"{path} left behind"
        assert not os.path.exists(cuts), f"{cuts} left behind"
    finally:
        if child.alive():
            os.killpg(child.pid, signal.SIGKILL)
            child.proc.wait(timeout=10)  # type: ignore[union-attr]

