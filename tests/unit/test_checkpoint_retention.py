"""Checkpoint retention: keep the newest N complete checkpoints, never the latest or the one the
run resumed from; deletion is rename-then-remove, so a crash never leaves a half checkpoint."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoint import CheckpointManager, DataPosition


def _model():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    return module, torch.optim.Adam(module.parameters(), lr=0.1)


def _step(module, opt) -> None:
    opt.zero_grad()
    module(torch.ones(2, 4)).sum().backward()
    opt.step()


def _names(ckpt: CheckpointManager) -> list[str]:
    return sorted(p.name for p in ckpt.root.iterdir())


def test_keeps_the_newest_n_and_the_latest_pointer(tmp_path):
    module, opt = _model()
    ckpt = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        _step(module, opt)
        ckpt.save(module, opt, DataPosition(step=step, policy_version=step))
    assert _names(ckpt) == ["latest", "step_000004", "step_000005"]
    assert ckpt.latest().name == "step_000005"
    # Each remaining checkpoint is whole: this rank's model and optimizer shard and the meta.
    assert sorted(p.name for p in ckpt.latest().iterdir()) == [
        "meta.json", "model_rank0.safetensors", "optim_rank0.pt"]


def test_zero_keeps_everything(tmp_path):
    module, opt = _model()
    ckpt = CheckpointManager(tmp_path, keep=0)
    for step in range(1, 5):
        ckpt.save(module, opt, DataPosition(step=step))
    assert len([n for n in _names(ckpt) if n.startswith("step_")]) == 4


def test_never_deletes_the_checkpoint_being_resumed_from(tmp_path):
    module, opt = _model()
    first = CheckpointManager(tmp_path, keep=1)
    for step in (1, 2):
        _step(module, opt)
        first.save(module, opt, DataPosition(step=step, policy_version=step))
    resumed = CheckpointManager(tmp_path, keep=1)
    pos = resumed.load(module, opt)
    assert pos.step == 2
    for step in (3, 4):
        _step(module, opt)
        resumed.save(module, opt, DataPosition(step=step, policy_version=step))
    # keep=1 would leave only step 4; step 2 stays while this run may still fall back to it.
    assert _names(resumed) == ["latest", "step_000002", "step_000004"]
    again = CheckpointManager(tmp_path, keep=1)
    assert again.load(module, opt).step == 4


def test_interrupted_saves_and_deletes_are_cleaned_up(tmp_path):
    module, opt = _model()
    ckpt = CheckpointManager(tmp_path, keep=1)
    ckpt.save(module, opt, DataPosition(step=1))
    (ckpt.root / "step_000002").mkdir()  # a save a crash cut short: no meta.json
    (ckpt.root / ".deleting-step_000000").mkdir()  # a delete a crash cut short
    (ckpt.root / "step_000009").mkdir()  # newer than latest: maybe a save in progress
    ckpt.save(module, opt, DataPosition(step=3))
    assert _names(ckpt) == ["latest", "step_000003", "step_000009"]


def test_negative_keep_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep_checkpoints"):
        CheckpointManager(tmp_path, keep=-1)
