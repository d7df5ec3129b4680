"""The trainer's start-up line that names its model path (issue 42: `trainer path: fast (...)`
on CUDA bf16 with no switch set, `reference` on CPU), read from a fresh interpreter that builds
a tiny MoE and a megatron trainer on it (the trainer sets up torch.distributed and, on CPU,
megatron's shims: nothing of that may leak into the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from trainer.backend import make_trainer
from trainer.config import TrainerConfig
from trainer.megatron.config import model_section
d = build_tiny_moe(sys.argv[1], TinyMoeConfig(num_layers=2, first_k_dense=1))
tr = make_trainer(TrainerConfig(model_dir=str(d), model={"dtype": "bf16"}))
m = model_section(tr.cfg)
print("RESOLVED", m.experts, m.attention, m.planned_dispatch, tr.cfg.optim.fused_adam,
      tr.cfg.loss.chunked_logprobs)
"""


def start_bf16_trainer(model_dir: Path, *, gpu: bool, timeout: float) -> tuple[list[str], str]:
    """(the log lines naming the trainer path, the whole stdout) of a bf16 megatron trainer
    with no model switch set; AssertionError with the output's tail if the child failed."""
    env = os.environ if gpu else dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [ln for ln in out.stdout.splitlines() if "trainer path:" in ln], out.stdout
