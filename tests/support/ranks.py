"""One launcher for the per-rank processes of tests and benches: `world` copies of a script,
each told its place in a torch.distributed world on loopback (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), run to the end under one deadline and killed by pid if they outlive it.

The rank's PYTHONPATH is the repository root *in front of* the caller's own entries, never in
their place (services.common.procenv: the lent GPU machines put megatron-core on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from services.common.net import free_port
from services.common.procenv import pythonpath

ROOT = Path(__file__).resolve().parents[2]


def rank_env(rank: int, world: int, port: int, *, gpu: bool = False,
             threads: int | None = 1) -> dict[str, str]:
    """This process's environment for rank `rank` of `world` (one OpenMP thread unless
    `threads` is None; no visible GPU unless `gpu`)."""
    env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "PYTHONPATH": pythonpath(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class RanksFailed(AssertionError):
    """A rank exited non-zero or outlived its deadline (the exit codes in rank order)."""


def run_ranks(argv_of: Callable[[int], Sequence[str]], world: int, *, gpu: bool = False,
              timeout: float | None = 200, threads: int | None = 1) -> None:
    """Run `python <argv_of(rank)>` once per rank and wait for all; RanksFailed unless every
    rank exits 0 within `timeout` seconds (None: no deadline)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *argv_of(rank)], cwd=ROOT,
                              env=rank_env(rank, world, port, gpu=gpu, threads=threads))
             for rank in range(world)]
    deadline = None if timeout is None else time.monotonic() + timeout
    codes: list[int | None] = []
    try:
        for p in procs:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                codes.append(p.wait(timeout=left))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * world:
        raise RanksFailed(f"rank exit codes {codes} (None: still running after {timeout} s)")


def run_script_ranks(script: str | Path, out_dir: Path, args: Sequence[str] = (),
                     world: int = 2, *, gpu: bool = False, timeout: float | None = 200,
                     threads: int | None = 1, name: str = "rank{rank}.json") -> list[dict]:
    """`python script <args[0]> <out_dir>/<name> <args[1:]>` per rank (each rank writes its
    results there as JSON); the JSON of each rank, in rank order."""
    outs = [out_dir / name.format(rank=r) for r in range(world)]
    run_ranks(lambda r: [str(Path(script).resolve()), *args[:1], str(outs[r]), *args[1:]],
              world, gpu=gpu, timeout=timeout, threads=threads)
    return [json.loads(p.read_text()) for p in outs]
