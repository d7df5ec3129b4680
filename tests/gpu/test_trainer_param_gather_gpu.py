"""optim.overlap_param_gather on two GPUs (NCCL): `pytest -m gpu`.

The equality test of tests/integration/test_trainer_param_gather.py (its rank worker is reused)
over NCCL, where the all-gather really runs asynchronously beside the forward: three GRPO steps
with the parameter all-gather left to the next forward's pre-hooks against the step-end gather,
DP 2, the distributed optimizer, grouped experts (bf16: `torch._grouped_mm`), small buckets.
The same two runs on the same GPUs: every metric, logprob, export, checkpoint weight and pushed
tensor equal bit for bit (both runs launch the same kernels on the same inputs).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                 reason="needs 2 CUDA GPUs")]
REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location(
    "trainer_param_gather_cpu", REPO / "tests/integration/test_trainer_param_gather.py")
P = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(P)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_overlap_param_gather_equals_the_step_end_gather(tmp_path, dtype):
    P.check_pair(P.run_pair(tmp_path, dtype, gpu=True))
