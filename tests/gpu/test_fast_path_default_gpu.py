"""Issue 42: a bf16 trainer config with no model switches set runs the fast path on a CUDA GPU
(TrainerConfig.fast_path: grouped experts, SDPA, planned dispatch, fused Adam, chunked
log-softmax), and its startup log says so in one line. The CPU counterpart (reference path) is
tests/unit/test_plan_fast_path.py.

    python -m pytest tests/gpu/test_fast_path_default_gpu.py -q -m gpu -p no:cacheprovider
"""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_path import start_bf16_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]


def test_startup_log_names_the_fast_path_on_cuda_bf16(tmp_path):
    lines, stdout = start_bf16_trainer(tmp_path / "tiny", gpu=True, timeout=600)
    print("\n".join(lines))
    assert len(lines) == 1, stdout[-3000:]
    assert lines[0].startswith("trainer.megatron.engine trainer path: fast "), lines
    assert "RESOLVED grouped sdpa True True True" in stdout
    assert "logprob_kernel triton)" in lines[0], lines  # issue 44
