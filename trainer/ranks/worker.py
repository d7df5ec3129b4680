"""One trainer rank: a GRPOStep over the configured backend (trainer.backend.make_trainer) plus
the per-rank halves of the loop's named steps.

The driver (trainer.loop.loop.TrainLoop) pulls groups from the store and hands each rank its share
as serialized `PulledGroup` bytes (the wire format, never pickled tensors). The rank decodes them,
aligns their routing and quarantines bad groups (trainer.samples.intake), trains (`train`), saves/resumes its checkpoint shard and
exports HF weights (to the weight push; to `<run_dir>/hf/` for evaluation: `export_hf_dir`).
The same class runs in-process (1 rank) or as a Ray actor (trainer.ranks.ray_launch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

from trainer.backend import make_trainer
from trainer.checkpoint import CheckpointManager, DataPosition
from trainer.config import TrainerConfig
from trainer.hf_export import HFExport
from trainer.samples.intake import intake_groups
from trainer.weight_push import RankSender

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # the in-process rank of `r3flow local` (no cluster runs it)


class RankWorker:
    """Trainer state of one rank (process groups come from RANK/WORLD_SIZE/MASTER_* env)."""

    rank = 0
    node_ip = ""  # this rank's node as Ray reports it ("" in-process: loopback)
    _sender: RankSender | None = None  # rank 0's weight-sync sender, made at the first push

    def __init__(self, cfg_json: str, rank: int = 0, node_ip: str = "") -> None:
        self.rank, self.node_ip = rank, node_ip
        self.cfg = TrainerConfig.model_validate_json(cfg_json)
        self.trainer = make_trainer(self.cfg)
        self.ckpt = CheckpointManager(self.cfg.run.run_dir, self.cfg.run.keep_checkpoints)
        self.hf_export = HFExport(self.cfg.run.run_dir, self.cfg.model_dir, self.cfg.run.hf_keep)

    def train(self, groups_bytes: Sequence[bytes], lr_scale: float = 1.0) -> dict:
        """Aligned samples of this rank's share -> one GRPO/PPO step (its updates at lr x
        `lr_scale`, the loop's step hooks'); `dropped` in the metrics names the groups
        quarantined (bad routing, unreproducible sampling, low agreement)."""
        from services.common.pb.r3flow.v1 import store_pb2

        arch = self.trainer.backend
        samples, dropped = intake_groups(
            [store_pb2.PulledGroup.FromString(b) for b in groups_bytes], self.cfg.replay.mode,
            self.trainer.layer_map, arch.num_experts, arch.top_k)
        metrics = self.trainer.train_step(samples, lr_scale=lr_scale)
        metrics["dropped"] = dropped | metrics.get("dropped", {})
        return metrics

    def save(self, pos: dict) -> str:
        return str(self.ckpt.save(*self.trainer.backend.checkpoint_state(), DataPosition(**pos)))

    def resume(self) -> dict | None:
        """Load the latest checkpoint if there is one; returns its data position."""
        if self.ckpt.latest() is None:
            return None
        pos = self.ckpt.load(*self.trainer.backend.checkpoint_state())
        self.trainer.policy_version = pos.policy_version
        return asdict(pos)

    def export_hf(self) -> dict:
        """HF-named weights (collective over EP: every rank must call it)."""
        return self.trainer.export_hf_state_dict()

    def export_hf_dir(self, step: int) -> str | None:
        """Every rank joins the export; rank 0 writes `<run_dir>/hf/step-N` and moves
        `hf/latest` to it (trainer.hf_export). Returns the directory on rank 0, else None."""
        weights = self.export_hf()
        if self.rank:
            return None
        return str(self.hf_export.write(weights, step))

    def plan_push(self, version: int, workers: list[bytes]) -> bytes | None:
        """Rank 0: the serialized weight-sync plan of push `version` (others: None)."""
        if self.rank:
            return None
        if self._sender is None:
            # weight_sync.advertise_addr, else this rank's node; loopback only in-process
            addr = self.cfg.weight_sync.advertise_addr or self.node_ip or LOOPBACK
            self._sender = RankSender(self.cfg.weight_sync, addr)
        return self._sender.plan(version, workers)

    def push_weights(self, plan: bytes) -> dict | None:
        """Every rank joins the streamed export; rank 0 sends it to the plan's members as it
        arrives (the result). No rank holds the whole model (TrainBackend.iter_hf_weights)."""
        chunk = self.cfg.weight_sync.resolved_bucket_bytes()
        weights = iter(self.trainer.backend.iter_hf_weights(
            sender=0, chunk_bytes=chunk, wire=self.cfg.weight_sync.wire_dtype))
        if self.rank:
            for _ in weights:  # a collective: this rank's part is sending its chunks
                pass
            return None
        assert self._sender is not None, "plan_push comes first"
        try:
            return self._sender.push(plan, weights)
        finally:
            for _ in weights:  # a failed push stops early: the other ranks still send
                pass

    def policy_version(self) -> int:
        return self.trainer.policy_version

    def set_policy_version(self, version: int) -> None:
        """Relabel the current weights (resume above what engines serve; an idle re-push)."""
        self.trainer.policy_version = version

