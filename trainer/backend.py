"""The factory of the trainer's step: the backend `TrainerConfig.backend` names (the protocol it
implements, `TrainBackend`, is in trainer.protocol) under the shared GRPO/PPO step (trainer.grpo).

The backends, loaded by name from trainer.registry.BACKENDS (this module imports none):
trainer.megatron.engine.MegatronBackend (megatron-core GPTModel, native RouterReplay, megatron
DDP + Adam, EP) and trainer.hf.engine.HFBackend (HF transformers, router hooks, FSDP2 + AdamW,
packed micro-batches).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.config import TrainerConfig
from trainer.grpo import GRPOStep
from trainer.protocol import TrainBackend
from trainer.registry import engine_class


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
    return engine_class(cfg.backend)(cfg)  # type: ignore[no-any-return]


def make_trainer(cfg: TrainerConfig) -> GRPOStep:
    """The GRPO/PPO step over the backend `cfg.backend` names."""
    return GRPOStep(make_backend(cfg))
