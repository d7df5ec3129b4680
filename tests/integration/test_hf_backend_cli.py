"""`r3flow train --backend hf` (trainer.cli.train with backend: hf) against a real store: pulls
groups with HF-natural routing (partial rollouts, a dense layer in the engine's view), trains in
r3, checkpoints, acks, and a restarted trainer resumes from its checkpoint. In-process: `train(cfg)`
is what `r3flow train` runs after loading its config."""

from __future__ import annotations

import json
import logging
import signal

import pytest

pytestmark = pytest.mark.timeout(300)


def test_run_hf_pulls_trains_checkpoints_and_resumes(tmp_path, store_process, caplog):
    from test_trainer_cli import _hf, make_group

    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from services.store.client import StoreClient
    from trainer.cli import train
    from trainer.config import TrainerConfig

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    hf = _hf(model)
    cfg = TrainerConfig.model_validate({
        "model_dir": str(model), "backend": "hf", "replay": {"mode": "r3", "agreement_floor": 0.9},
        "data": {"store": store_process.address, "groups_per_step": 2, "wait_ms": 5000,
                 "micro_batch_size": 2, "consumer": "trainer-hf"},
        "run": {"run_dir": str(tmp_path / "run"), "checkpoint_every": 1, "steps": 1}})
    old_handler = signal.getsignal(signal.SIGTERM)
    try:
        with StoreClient(store_process.address) as client, caplog.at_level(logging.INFO):
            for g in range(4):
                for traj in make_group(hf, f"hf-{g}", 2, seed=g):
                    client.append_trajectory(traj)
            assert train(cfg) == 0
            assert train(cfg) == 0  # a restarted trainer: resumes from the checkpoint
            stats = client.stats()
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    lines = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert [x["policy_version"] for x in lines] == [1, 2]
    assert lines[0]["routing_agreement"] > 0.99 and lines[0]["logprob_diff_mean"] < 1e-3
    assert stats.groups_acked >= 4 and stats.policy_version == 2
    assert "resumed at step 1" in caplog.text
