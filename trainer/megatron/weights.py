"""MegatronWeights: the per-rank checkpoint files of a megatron model (trainer.checkpoint's
RankWeights with the megatron names)."""

from __future__ import annotations

import torch

from trainer.checkpoint import RankWeights
from trainer.megatron.model import copy_into
from trainer.megatron.parallel import model_weights


class MegatronWeights(RankWeights):
    """The per-rank checkpoint files of a megatron model: its parameters and the routers' bias
    buffers (parallel.model_weights), loaded through model.copy_into (grouped experts restacked
    from the SequentialMLP names older checkpoints hold)."""

    def weights(self) -> dict[str, torch.Tensor]:
        return model_weights(self.module)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        copy_into(self.module, tensors)
