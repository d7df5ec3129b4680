"""One trainer rank: a Trainer plus the per-rank halves of the loop's named steps.

The driver (trainer.step.TrainLoop) pulls groups from the store and hands each rank its share
as serialized `PulledGroup` bytes (the wire format, never pickled tensors). The rank decodes and
aligns the routing (`align_routing`), trains (`train`), saves/resumes its checkpoint shard and
exports HF weights. The same class runs in-process (1 rank) or as a Ray actor (trainer.ray_launch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

from trainer.batch import Sample
from trainer.checkpoint import CheckpointManager, DataPosition
from trainer.config import TrainerConfig
from trainer.intake import group_samples

log = logging.getLogger(__name__)


class RankWorker:
    """Trainer state of one rank (process groups come from RANK/WORLD_SIZE/MASTER_* env)."""

    def __init__(self, cfg_json: str) -> None:
        from trainer.engine import Trainer

        self.cfg = TrainerConfig.model_validate_json(cfg_json)
        self.trainer = Trainer(self.cfg)
        self.ckpt = CheckpointManager(self.cfg.run.run_dir)

    def align_routing(self, groups_bytes: Sequence[bytes]) -> list[Sample]:
        """Decode groups; each trajectory's routing -> its layer map -> this model's MoE layers."""
        from services.common.pb.r3flow.v1 import store_pb2

        arch = self.trainer.arch
        return [s for b in groups_bytes
                for s in group_samples(store_pb2.PulledGroup.FromString(b), self.cfg.replay.mode,
                                       self.trainer.layer_map, arch.num_experts, arch.top_k)]

    def train(self, groups_bytes: Sequence[bytes]) -> dict:
        """align_routing + one GRPO/PPO step on this rank's share."""
        return self.trainer.train_step(self.align_routing(groups_bytes))

    def save(self, pos: dict) -> str:
        return str(self.ckpt.save(self.trainer.policy.module, self.trainer.optimizer,
                                  DataPosition(**pos)))

    def resume(self) -> dict | None:
        """Load the latest checkpoint if there is one; returns its data position."""
        if self.ckpt.latest() is None:
            return None
        pos = self.ckpt.load(self.trainer.policy.module, self.trainer.optimizer)
        self.trainer.policy_version = pos.policy_version
        return asdict(pos)

    def export_hf(self) -> dict:
        """HF-named weights (collective over EP: every rank must call it)."""
        return self.trainer.export_hf_state_dict()

    def policy_version(self) -> int:
        return self.trainer.policy_version

    def set_policy_version(self, version: int) -> None:
        """Relabel the current weights (resume above what engines serve; an idle re-push)."""
        self.trainer.policy_version = version
