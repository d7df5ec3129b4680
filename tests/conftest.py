"""How make test spreads the suite over pytest-xdist workers (`-n 2 --dist loadfile`,
scripts/test.sh); without xdist (a plain pytest run) nothing here changes anything.

- A test file runs whole on one worker, so a module fixture is built once; files that share one
  session fixture (SHARED) run together on one worker, so that fixture is built once too
  (SharedFileScheduling: xdist's loadfile with those files merged. Not xdist_group marks:
  pytest-xdist 3.8's loadgroup renames items through `item._nodeid`, which pytest 9 no longer
  reads, so the marks group nothing).
- Files are queued longest first (COST_S, seconds on a fresh clone of the 2-core CI box), so
  the long ones start at once and the short files fill in beside them (scripts/test.sh passes
  --no-loadscope-reorder so that xdist keeps this order). xdist hands the first unit to gw0,
  the second to gw1, and each later one to the first worker left with <= 2 tests to run: the
  two units that each run a whole `r3flow local` topology under a fixture for minutes
  (local_run_dir, the fault suite) are the first two, so they never share a worker, each
  paired with one of the next two (the family chains, the real-MoE rollouts and benches).
- Each worker has its own part of the port range (services.common.net: R3FLOW_PORT_RANGE),
  inherited by every process its tests start: two workers' port picks cannot collide.
- vLLM-CPU binds an engine's OMP threads to the first core the process may use, keeping the
  last for its frontend (VLLM_CPU_OMP_THREADS_BIND=auto, one reserved CPU): on the 2-core box
  every engine binds to core 0. Worker 0 keeps every core (its engines bind to core 0, the
  processes around them take core 1 when it is free); worker i > 0 is held to core i
  (sched_setaffinity, inherited), so its engines bind there, never beside worker 0's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common import net

ROOT = Path(__file__).resolve().parents[1]

# file -> group, for files whose tests share one session fixture (tests/integration/conftest.py)
SHARED = {
    **dict.fromkeys(["tests/integration/test_families.py",
                     "tests/integration/test_family_glm4_moe.py",
                     "tests/integration/test_family_gpt_oss.py",
                     "tests/integration/test_trainer_mla.py"], "family_chain"),
    **dict.fromkeys(["tests/integration/test_local_run.py",
                     "tests/integration/test_local_alerts.py"], "local_run_dir"),
    **dict.fromkeys(["tests/integration/test_trainer_vllm.py",
                     "tests/integration/test_bench_smoke.py"], "real_moe_rollouts"),
}
# group -> seconds (make test on a fresh clone, issue 43: CI3's log of 8b65123, the offline
# engines' saving since taken off family_chain and real_moe_rollouts); groups not named here go
# after these, in collection order. Rough is enough: it only orders the queue.
COST_S = {
    "local_run_dir": 410, "tests/faults/test_faults.py": 370, "real_moe_rollouts": 360,
    "family_chain": 350, "tests/faults/test_sigterm_stop.py": 140,
    "tests/integration/test_local_family.py": 125, "tests/faults/test_engine_death.py": 100,
    "tests/integration/test_weight_push_megatron.py": 80, "tests/unit/test_hf_gather_to.py": 45,
    "tests/unit/test_hf_routers.py": 40, "tests/integration/test_router_margins.py": 70,
}


def _worker() -> tuple[int, int] | None:
    """(index, count) of this pytest-xdist worker; None outside xdist."""
    name, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not name or not count:
        return None
    return int(name.removeprefix("gw")), int(count)


def _own_share(index: int, count: int) -> None:
    """This worker's part of the port range and (worker > 0) its core, for it and every
    process it starts."""
    ports = range(net.LOWEST_PORT, net.ephemeral_low())
    width = len(ports) // count
    os.environ[net.RANGE_ENV] = f"{ports.start + index * width}-{ports.start + (index + 1) * width - 1}"
    cores = sorted(os.sched_getaffinity(0))
    if index > 0 and len(cores) >= count:
        os.sched_setaffinity(0, {cores[index * len(cores) // count]})


if (_w := _worker()) is not None:
    _own_share(*_w)


def group_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or the SHARED group its file belongs to."""
    path = nodeid.split("::", 1)[0]
    return SHARED.get(path, path)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: pytest without it (GPU machine) skips it
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return SharedFileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _worker() is None:
        return
    # stable: within a group, and among the groups without a cost, collection order stays
    items.sort(key=lambda it: -COST_S.get(group_of(it.nodeid), 0))
