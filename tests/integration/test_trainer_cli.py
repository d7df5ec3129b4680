"""`r3flow train` against a real store: pulls groups with HF-natural routing (partial rollouts,
prompt chunk stored once per group), trains in r3, checkpoints, acks, and a restarted trainer
resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.procenv import pythonpath

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inv, _ = hf.model.rotary_emb.compute_default_rope_parameters(hf.config)
    hf.model.rotary_emb.inv_freq.copy_(inv)
    return hf


def _natural(hf, tokens: np.ndarray):
    """Engine view of HF routing for all 3 layers (dense layer 0 gets a copy of layer 1) and
    the sampled-token logprobs."""
    with torch.no_grad():
        out = hf(torch.from_numpy(tokens)[None], output_router_logits=True)
    moe = [r.topk(2, -1).indices.numpy() for r in out.router_logits]  # 2 x [T, K]
    rows_TLK = np.stack([moe[0], moe[0], moe[1]], 1)[:-1]  # P+R-1 rows
    lp = torch.log_softmax(out.logits[0], -1)[:-1].gather(-1, torch.from_numpy(tokens[1:])[:, None])
    return rows_TLK.astype(np.uint8), lp[:, 0].numpy()


def make_group(hf, group_id: str, size: int, seed: int):
    from services.store.synthetic import build_trajectory

    rng = np.random.default_rng(seed)
    prompt = rng.integers(4, 100, 6)
    out = []
    for i in range(size):
        seg_lens = [int(rng.integers(3, 6)), int(rng.integers(2, 5))]  # a partial rollout
        tokens = np.concatenate([prompt, rng.integers(4, 100, sum(seg_lens))])
        rows_TLK, lp = _natural(hf, tokens)
        traj = build_trajectory(f"{group_id}/{i}", group_id, size, prompt_ids_TLK=rows_TLK[:6],
                                response_ids_TLK=rows_TLK[6:], segment_lengths=seg_lens,
                                num_experts=8, seed=seed * 10 + i)
        traj.prompt_token_ids[:] = prompt.tolist()
        traj.reward = float(i % 2)
        start = 0
        for seg, n in zip(traj.segments, seg_lens, strict=True):
            seg.token_ids[:] = tokens[6 + start:6 + start + n].tolist()
            seg.logprobs[:] = lp[5 + start:5 + start + n].tolist()
            start += n
        out.append(traj)
    return out


def _train(cfg_path: Path, steps: int) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "services.cli", "train", "--config",
                           str(cfg_path), "--steps", str(steps)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


def test_train_cli_pulls_trains_checkpoints_and_resumes(tmp_path, store_process):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from services.store.client import StoreClient

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    hf = _hf(model)
    cfg = {"model_dir": str(model), "replay": {"mode": "r3", "agreement_floor": 0.9},
           "data": {"store": store_process.address, "groups_per_step": 2, "wait_ms": 5000,
                    "micro_batch_size": 2, "consumer": "trainer-cli"},
           "run": {"run_dir": str(tmp_path / "run"), "checkpoint_every": 1}}
    cfg_path = tmp_path / "train.json"
    cfg_path.write_text(json.dumps(cfg))
    with StoreClient(store_process.address) as client:
        for g in range(4):
            for traj in make_group(hf, f"cli-{g}", 2, seed=g):
                client.append_trajectory(traj)
        first = _train(cfg_path, 1)
        assert first.returncode == 0, first.stderr[-3000:]
        second = _train(cfg_path, 1)  # a restarted trainer: resumes from the checkpoint
        assert second.returncode == 0, second.stderr[-3000:]
        stats = client.stats()
    lines = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert [x["policy_version"] for x in lines] == [1, 2]
    assert lines[0]["routing_agreement"] > 0.99 and lines[0]["logprob_diff_mean"] < 1e-3
    assert stats.groups_acked >= 4 and stats.policy_version == 2
    assert "resumed at step 1" in second.stderr
