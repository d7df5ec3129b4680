"""The hf backend on 1 vs 2 GPUs (FSDP2 over NCCL, fp32, no Ray): the same r3 step gives the
same logprobs before and after it, grad norm and weights (tests/bench/hf_ranks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="needs 2 GPUs")]


@pytest.mark.parametrize("extra", [[], ["--sharding", "hybrid", "--shard-group", "1"]])
def test_one_and_two_gpus_take_the_same_step(tmp_path, extra):
    out = tmp_path / "hf_ranks.json"
    subprocess.run([sys.executable, str(ROOT / "tests/bench/hf_ranks.py"), "--worlds", "1", "2",
                    *extra, "--out", str(out)], check=True, timeout=600)
    two = json.loads(out.read_text())["2"]
    assert two["sharded"] and two["agreement"] == 1.0
    assert two["lp_before_max_diff"] < 1e-4 and two["lp_after_max_diff"] < 1e-4
    assert two["grad_norm_rel_diff"] < 1e-4 and two["weights_max_diff"] < 1e-5
