"""`r3flow train --backend hf`: the store-driven loop (trainer.loop.loop.TrainLoop) on HFTrainer ranks.

Everything but the rank's trainer is the megatron backend's: config, store pull/ack, metrics and
run log, weight push, checkpoint layout (trainer.checkpoint, one file per rank; under FSDP2 each
rank saves its own parameter shards). HF-only knobs (trainer.hf.config.HFBackendConfig) come from
`--hf-config FILE` when the CLI offers it, else defaults. The CLI runs one in-process rank
(`run.launcher: local`); multi-rank FSDP2 is HFTrainer's (every rank a process with RANK/
WORLD_SIZE/MASTER_* set), but no launcher drives several HF ranks from the store yet.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from trainer.checkpoint import CheckpointManager, DataPosition
from trainer.config import TrainerConfig
from trainer.hf.config import HFBackendConfig
from trainer.hf_export import HFExport
from trainer.worker import RankWorker

log = logging.getLogger(__name__)


class _LocalShards:
    """This rank's parameters as plain tensors (FSDP2 DTensor -> local shard) for checkpoints."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.module.named_parameters():
            yield name, p.to_local() if hasattr(p, "to_local") else p


class HFRankWorker(RankWorker):
    """RankWorker (routing alignment, train, weight export, `export_hf_dir`) around an
    HFTrainer; export_hf is HFTrainer's (checkpoint-named, FSDP2 shards gathered)."""

    def __init__(self, cfg_json: str, hf_json: str = "{}") -> None:
        from trainer.hf.engine import HFTrainer

        self.cfg = TrainerConfig.model_validate_json(cfg_json)
        self.hf = HFBackendConfig.model_validate_json(hf_json)
        self.hf_trainer = HFTrainer(self.cfg, self.hf)
        self.trainer = self.hf_trainer  # type: ignore[assignment]  # RankWorker's methods use it
        self.rank = self.hf_trainer.rank  # only rank 0 writes the HF export (export_hf_dir)
        self.ckpt = CheckpointManager(self.cfg.run.run_dir, self.cfg.run.keep_checkpoints)
        self.hf_export = HFExport(self.cfg.run.run_dir, self.cfg.model_dir, self.cfg.run.hf_keep)

    def save(self, pos: dict) -> str:
        shards: Any = _LocalShards(self.hf_trainer.model)
        return str(self.ckpt.save(shards, self.hf_trainer.optimizer, DataPosition(**pos)))

    def resume(self) -> dict | None:
        """Load the latest checkpoint if there is one; returns its data position."""
        if self.ckpt.latest() is None:
            return None
        shards: Any = _LocalShards(self.hf_trainer.model)
        pos = self.ckpt.load(shards, self.hf_trainer.optimizer)
        self.hf_trainer.policy_version = pos.policy_version
        return asdict(pos)


class HFLocalRanks:
    """One in-process HF rank (trainer.loop.ranks.RankTransport)."""

    world_size = 1

    def __init__(self, cfg: TrainerConfig, hf: HFBackendConfig) -> None:
        self.worker = HFRankWorker(cfg.model_dump_json(), hf.model_dump_json())

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        return [getattr(self.worker, method)(*per_rank_args[0])]


def load_hf_config(args: argparse.Namespace) -> HFBackendConfig:
    """HFBackendConfig from `args.hf_config` (a file) when given, else defaults."""
    from services.common.config import load_config

    path = getattr(args, "hf_config", None)
    return load_config(HFBackendConfig, path, {}) if path else HFBackendConfig.model_validate({})


def run_hf(cfg: TrainerConfig, args: argparse.Namespace) -> int:
    """The `r3flow train` loop with the HF/FSDP2 backend; returns the exit code."""
    from prometheus_client import CollectorRegistry

    from services.common.auth import ClientAuth
    from services.common.metrics import MetricsServer, create_metrics
    from services.store.client import StoreClient
    from trainer.loop.loop import TrainLoop
    from trainer.weight_push import StoreWeightPush

    if cfg.run.launcher != "local":
        raise ValueError("run.launcher: the hf backend supports only 'local' (one in-process "
                         "rank) for now")
    hf = load_hf_config(args)
    log.info("hf backend config: %s", hf.model_dump_json())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    registry = CollectorRegistry()
    server = MetricsServer(registry, cfg.run.metrics_host, cfg.run.metrics_port).start()
    log.info("trainer metrics on %s", server.url)
    try:
        auth = ClientAuth.from_config(cfg.data.store_auth)
        with StoreClient(cfg.data.store, auth=auth) as client:
            client.wait_ready(cfg.run.store_ready_timeout_s)
            ranks = HFLocalRanks(cfg, hf)
            push = StoreWeightPush(client) if cfg.run.push_weights_every else None
            loop = TrainLoop(cfg, ranks, client, create_metrics(registry, "trainer"), push)
            loop.resume()
            history = loop.run(cfg.run.steps, stop=stop.is_set)
    finally:
        server.stop()
    log.info("trained %d steps (hf backend); policy version %d", len(history),
             loop.pos.policy_version)
    return 0
