"""Checkpoints a restarted trainer resumes from: model, optimizer, data position, policy version.

Layout under `<run_dir>/checkpoints/`:
  step_000012/model_rank0.safetensors   this rank's parameters (megatron names, local experts)
  step_000012/optim_rank0.pt            megatron optimizer state_dict (Adam moments, step)
  step_000012/meta.json                 step, policy version, data position (rank 0 writes)
  latest                                name of the newest complete checkpoint (rank 0, atomic)
Data position: the delivery ids acked after this checkpoint and the group ids trained so far
(bounded), so a group the store redelivers after a crash is recognised and not trained twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class DataPosition:
    """What the trainer has consumed."""

    step: int = 0
    policy_version: int = 0
    acked_delivery_ids: list[str] = field(default_factory=list)
    trained_group_ids: list[str] = field(default_factory=list)

    def remember(self, group_ids: list[str], keep: int = 10000) -> None:
        self.trained_group_ids = (self.trained_group_ids + list(group_ids))[-keep:]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    """Save/resume for one trainer rank (every rank calls save/load; rank 0 writes meta)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / "checkpoints"

    def latest(self) -> Path | None:
        ptr = self.root / "latest"
        if not ptr.is_file():
            return None
        path = self.root / ptr.read_text().strip()
        return path if (path / "meta.json").is_file() else None

    def save(self, module: torch.nn.Module, optimizer, pos: DataPosition) -> Path:
        """Write this rank's shard; rank 0 writes meta and flips `latest` after all ranks."""
        from safetensors.torch import save_file

        rank, path = _rank(), self.root / f"step_{pos.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        params = {k: v.detach().contiguous().clone() for k, v in module.named_parameters()}
        save_file(params, str(path / f"model_rank{rank}.safetensors"))
        torch.save(optimizer.state_dict(), path / f"optim_rank{rank}.pt")
        _barrier()
        if rank == 0:
            (path / "meta.json").write_text(json.dumps(asdict(pos)))
            tmp = self.root / "latest.tmp"
            tmp.write_text(path.name)
            os.replace(tmp, self.root / "latest")
        _barrier()
        return path

    def load(self, module: torch.nn.Module, optimizer, path: Path | None = None) -> DataPosition:
        """Restore this rank's shard and the optimizer; returns the saved data position."""
        from safetensors.torch import load_file

        from trainer.model import copy_into

        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"checkpoint: nothing to resume under {self.root}")
        rank = _rank()
        copy_into(module, load_file(str(path / f"model_rank{rank}.safetensors")))
        state = torch.load(path / f"optim_rank{rank}.pt", weights_only=False)
        optimizer.load_state_dict(state)
        return DataPosition(**json.loads((path / "meta.json").read_text()))
