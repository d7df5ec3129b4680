"""Fuzz every `r3flow` command's inputs in-process: mutated flags, config files and manifests.

Each case calls `services.cli.main(argv)` as the console script does (server commands with
`--check`, which runs exactly the `load(args)` that `run` starts with, so nothing is started;
`plan` runs whole, it starts nothing). Every case must end in success (exit 0; `plan` 1 = does
not fit) or in exit 2 with one line `r3flow <command>: ...` naming the flag, key or file (plus
at most a hint line); never an exception, never a hang; nothing written, no thread, child
process or signal handler left behind. Fixed seed; the case count is printed (and recorded in
RELIABILITY.md).
"""

from __future__ import annotations

import io
import random
import re
import signal
import threading
import time
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import psutil
import pytest
from cli_fuzz_cases import Case, config_cases, flag_cases, manifest_cases, write_inputs

from services import cli

SEED = 35
N_CONFIG = 1600
N_MANIFEST = 300
CASE_LIMIT_S = 10.0


def run_case(case: Case) -> tuple[int, str]:
    """(exit code, stderr) of `r3flow ARGV`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = cli.main(case.argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def problem(case: Case, rc: int, err: str) -> str | None:
    """What is wrong with the outcome of `case`, or None."""
    if rc == 0 or (rc == 1 and case.command == "plan"):
        return None
    if rc != 2:
        return f"exit {rc}"
    lines = err.strip().splitlines()
    if not 1 <= len(lines) <= 2 or "Traceback" in err:
        return f"{len(lines)} lines on stderr"
    if not re.match(rf"r3flow {case.command}( [a-z-]+)?: ", lines[0]):  # `model tiny-moe: `
        return "not `r3flow <command>: ...`"
    if not any(n in lines[0] for n in case.needles):
        return f"names none of {case.needles}"
    return None


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*") if p.is_file()}


@pytest.mark.timeout(300)
def test_every_command_refuses_mutated_inputs_on_one_line(tmp_path, monkeypatch):
    inputs, cwd = tmp_path / "in", tmp_path / "cwd"
    inputs.mkdir()
    cwd.mkdir()
    files = write_inputs(inputs)
    monkeypatch.chdir(cwd)
    rng = random.Random(SEED)
    cases = [*flag_cases(files, inputs), *config_cases(rng, files, inputs, N_CONFIG),
             *manifest_cases(rng, inputs, N_MANIFEST)]
    before = snapshot(inputs)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads = threading.active_count()
    children = set(psutil.Process().children())  # e.g. multiprocessing's resource tracker
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    t0 = time.monotonic()
    for case in cases:
        start = time.monotonic()
        try:
            rc, err = run_case(case)
        except Exception as e:  # noqa: BLE001 -- a bug: collect it with its case
            rc, err = -1, f"{type(e).__name__}: {e}"
        why = "raised" if rc == -1 else problem(case, rc, err)
        if time.monotonic() - start > CASE_LIMIT_S:
            why = f"took {time.monotonic() - start:.1f} s"
        outcomes[f"{case.command} exit {rc}"] += 1
        if why:
            failures.append(f"{why}: {case.kind} {case.argv}\n    {err.strip()[-400:]}")
    elapsed = time.monotonic() - t0
    print(f"\ncli fuzz: {len(cases)} cases in {elapsed:.1f} s (seed {SEED}): "
          f"{dict(sorted(outcomes.items()))}; kinds {dict(Counter(c.kind for c in cases))}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:15])
    assert list(cwd.iterdir()) == [], "a command wrote into the working directory"
    assert snapshot(inputs) == before, "an input file was written or changed"
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "a signal handler was set"
    assert threading.active_count() == threads, "a thread was started"
    assert set(psutil.Process().children()) <= children, "a process was started"
    assert outcomes and sum(v for k, v in outcomes.items() if k.endswith("exit 2")) > len(cases) / 3
