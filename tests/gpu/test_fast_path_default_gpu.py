"""Issue 42: a bf16 trainer config with no model switches set runs the fast path on a CUDA GPU
(TrainerConfig.fast_path: grouped experts, SDPA, planned dispatch, fused Adam, chunked
log-softmax), and its startup log says so in one line. The CPU counterpart (reference path) is
tests/unit/test_plan_fast_path.py.

    python -m pytest tests/gpu/test_fast_path_default_gpu.py -q -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]

_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from trainer.backend import make_trainer
from trainer.config import TrainerConfig
d = build_tiny_moe(sys.argv[1], TinyMoeConfig(num_layers=2, first_k_dense=1))
tr = make_trainer(TrainerConfig(model_dir=str(d), model={"dtype": "bf16"}))
m = tr.cfg.model
print("RESOLVED", m.experts, m.attention, m.planned_dispatch, tr.cfg.optim.fused_adam,
      tr.cfg.loss.chunked_logprobs)
"""


def test_startup_log_names_the_fast_path_on_cuda_bf16(tmp_path):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "tiny")],
                         cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if "trainer path:" in ln]
    print("\n".join(lines))
    assert len(lines) == 1, out.stdout[-3000:]
    assert lines[0].startswith("trainer.megatron.engine trainer path: fast "), lines
    assert "RESOLVED grouped sdpa True True True" in out.stdout
