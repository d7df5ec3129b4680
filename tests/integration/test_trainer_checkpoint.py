"""A restarted trainer resumes: same weights, optimizer moments, data position, policy version."""

from __future__ import annotations

import pytest
import torch
from trainer_fixtures import toy_samples

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("optim", [{}, {"use_distributed_optimizer": True}],
                         ids=["adam", "distributed_optimizer"])
def test_resume_continues_exactly(tmp_path, optim):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from trainer.backend import make_trainer
    from trainer.checkpoint import CheckpointManager, DataPosition
    from trainer.config import TrainerConfig

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=2))
    cfg = TrainerConfig(model_dir=str(model), replay={"mode": "r2"}, optim={"lr": 1e-3} | optim,
                        data={"micro_batch_size": 2})
    ckpt = CheckpointManager(tmp_path / "run")
    first = make_trainer(cfg)
    for seed in (1, 2):
        first.train_step(toy_samples(seed))
    pos = DataPosition(step=2, policy_version=first.policy_version,
                       acked_delivery_ids=["d1", "d2"], trained_group_ids=["g0", "g1"])
    ckpt.save(*first.backend.checkpoint_state(), pos)
    expected = first.train_step(toy_samples(3))
    want = {k: v.detach().clone() for k, v in first.backend.policy.module.named_parameters()}

    second = make_trainer(cfg)  # a fresh process would see the same: weights from the HF checkpoint
    assert ckpt.latest() is not None and ckpt.latest().name == "step_000002"
    got_pos = ckpt.load(*second.backend.checkpoint_state())
    second.policy_version = got_pos.policy_version
    assert got_pos == pos
    again = second.train_step(toy_samples(3))
    assert again["policy_version"] == expected["policy_version"] == 3
    assert again["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    for k, v in second.backend.policy.module.named_parameters():  # Adam moments restored too
        torch.testing.assert_close(v, want[k], atol=1e-6, rtol=1e-5)
