"""`TrainBackend`: what the shared GRPO/PPO step (trainer.grpo) needs from a model backend, and
the factory keyed on `TrainerConfig.backend`.

Two implementations: trainer.megatron.engine.MegatronBackend (megatron-core GPTModel, native
RouterReplay, megatron DDP + Adam, EP) and trainer.hf.engine.HFBackend (HF transformers, router
hooks, FSDP2 + AdamW, packed micro-batches).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from trainer.batch import MicroBatch, Sample
from trainer.config import TrainerConfig
from trainer.replay import AgreementStats, ReplayMode

if TYPE_CHECKING:
    from trainer.grpo import GRPOStep

# (micro-batch, its logits) -> its share of the update's loss (already divided by the update's
# token count); a backend whose schedule averages over micro-batches undoes that itself.
LossFn = Callable[[MicroBatch, torch.Tensor], torch.Tensor]


class TrainBackend(Protocol):
    """Model, optimizer and routing replay of one trainer rank."""

    cfg: TrainerConfig
    moe_layers: tuple[int, ...]  # HF layer index of each MoE layer, in router order
    num_experts: int
    top_k: int
    padded: int  # filler micro-batches of the last `microbatches` call

    @property
    def agreement(self) -> AgreementStats:
        """The policy's routing agreement counters (fed by `logits` and `update`)."""
        ...

    def microbatches(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """`samples` cut into micro-batches on this rank's device (collective where the
        backend needs as many on every rank)."""
        ...

    def no_grad_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode, reference: bool
                     ) -> AbstractContextManager[None]:
        """Around the forwards of a no-grad pass over `mbs` (eval mode, staged replay ids)."""
        ...

    def logits(self, mb: MicroBatch, mode: ReplayMode, reference: bool = False) -> torch.Tensor:
        """[B, S, V] logits of `mb` under `mode` (r2 records the policy's routing on `mb`);
        feeds the agreement counters of the policy."""
        ...

    def update(self, mbs: Sequence[MicroBatch], mode: ReplayMode, loss_fn: LossFn) -> float:
        """Forward/backward over `mbs` + clip + optimizer step; returns the grad norm."""
        ...

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (a collective: every rank calls it)."""
        ...

    def checkpoint_state(self) -> tuple[Any, Any]:
        """(what holds this rank's parameters, its optimizer) for trainer.checkpoint."""
        ...


def check_mtp(cfg: TrainerConfig) -> None:
    """Refuse a checkpoint with multi-token-prediction layers unless `drop_mtp` says to train
    without them (r3flow does not train MTP yet)."""
    path = Path(cfg.model_dir) / "config.json"
    n = int(json.loads(path.read_text()).get("num_nextn_predict_layers") or 0) \
        if path.is_file() else 0
    if n and not cfg.drop_mtp:
        raise ValueError(f"num_nextn_predict_layers: the checkpoint has {n} multi-token-"
                         f"prediction layer(s) and r3flow does not train MTP; set drop_mtp: true "
                         f"to train the main model without them (neither trained nor exported)")


def make_backend(cfg: TrainerConfig) -> TrainBackend:
    """The backend `cfg.backend` names (process groups are initialised here)."""
    check_mtp(cfg)
    if cfg.backend == "hf":
        from trainer.hf.engine import HFBackend

        return HFBackend(cfg)
    from trainer.megatron.engine import MegatronBackend

    return MegatronBackend(cfg)


def make_trainer(cfg: TrainerConfig) -> GRPOStep:
    """The GRPO/PPO step over the backend `cfg.backend` names."""
    from trainer.grpo import GRPOStep

    return GRPOStep(make_backend(cfg))
