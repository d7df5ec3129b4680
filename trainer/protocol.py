"""What a model backend provides to the shared GRPO/PPO step: `TrainBackend` and `LossFn`.

The bottom of the trainer's layers: trainer.grpo (the step) is written against this protocol,
trainer.megatron.engine.MegatronBackend and trainer.hf.engine.HFBackend implement it, and
trainer.backend (the factory) picks one by `TrainerConfig.backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from trainer.config import TrainerConfig
from trainer.replay import AgreementStats, ReplayMode
from trainer.samples.batch import MicroBatch, Sample

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
    data_parallel_size: int  # replicas the gradient reduction averages over (loss normaliser)
    current: MicroBatch | None  # the micro-batch in a forward/backward now (fault blame)

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
        """Forward/backward over `mbs` + clip + optimizer step; returns the grad norm. A vote
        before the step (trainer.guard.checkpoint) skips it on every rank when any rank's loss
        or gradients are non-finite (trainer.guard.PeerFault, nothing applied)."""
        ...

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on rank 0 (a collective: every rank calls it; other ranks may
        get them too, or an empty dict: the HF backend gathers to rank 0 only)."""
        ...

    def iter_hf_weights(self, sender: int = 0, chunk_bytes: int = 256 << 20,
                        wire: str | None = None) -> Iterable[Any]:
        """The HF-named weights streamed to rank `sender` (a collective: every rank iterates
        it once, to the end; only `sender` gets tensors, each valid until the next one is drawn
        unless kept). No rank holds the whole model: memory is bounded by `chunk_bytes`.
        Items are (name, tensor) pairs; with `wire` (a weight-sync wire dtype) a backend may
        give whole packed buckets instead (weight_sync.buckets.PackedBucket): either is what
        WeightSender.push takes."""
        ...

    def checkpoint_state(self) -> tuple[Any, Any]:
        """(what holds this rank's parameters, its optimizer) for trainer.checkpoint."""
        ...
