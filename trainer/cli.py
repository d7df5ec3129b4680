"""`r3flow train`: the GRPO/PPO trainer with routing replay, fed by the store.

Command-line flags override the config file (`--store` -> data.store, `--model` -> model_dir,
`--replay` -> replay.mode, `--steps` -> run.steps, `--run-dir` -> run.run_dir,
`--metrics-port` -> run.metrics_port, `--backend` -> backend, `--hf-config FILE` -> the hf
section). One path for both backends (megatron-core, HF + FSDP2); heavy imports happen inside
`train` (instant --help).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_OVERRIDES = {"store": "data.store", "model": "model_dir", "replay": "replay.mode",
              "steps": "run.steps", "run_dir": "run.run_dir", "metrics_port": "run.metrics_port",
              "backend": "backend"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TrainerConfig file (.toml/.yaml/.json)")
    p.add_argument("--store", help="TrajectoryStore address host:port")
    p.add_argument("--model", help="HF checkpoint directory (Qwen3-MoE)")
    p.add_argument("--replay", choices=["r3", "r2", "off"], help="routing replay mode")
    p.add_argument("--steps", type=int, help="optimizer steps (0 = until SIGTERM)")
    p.add_argument("--run-dir", help="checkpoints and train_log.jsonl")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = free port)")
    p.add_argument("--backend", choices=["megatron", "hf"],
                   help="megatron-core (default) or HF transformers + FSDP2 (docs/hf_backend.md)")
    p.add_argument("--hf-config", help="HFBackendConfig file: the config's hf section")


def load(args: argparse.Namespace):
    """TrainerConfig from --config plus flag overrides (ConfigError names a bad key)."""
    from services.common.config import load_config, read_mapping
    from trainer.config import TrainerConfig

    overrides = {key: getattr(args, name) for name, key in _OVERRIDES.items()
                 if getattr(args, name, None) is not None}
    if getattr(args, "hf_config", None):
        overrides["hf"] = read_mapping(args.hf_config)
    return load_config(TrainerConfig, args.config, overrides)


def _ranks(cfg):
    if cfg.run.launcher == "ray":
        from trainer.ranks.ray_launch import RayRanks

        return RayRanks(cfg, cfg.run.world_size)
    from trainer.ranks.local_ranks import LocalRanks

    return LocalRanks(cfg)


def _stop_on_sigterm(stop: threading.Event) -> None:
    """SIGTERM sets `stop`: the loop ends after its step, checkpoints and exits 0. Ray's
    driver (ray.init) installs a handler of its own that aborts the process (exit -6,
    no checkpoint), so this is installed again once the ranks are up."""
    signal.signal(signal.SIGTERM, lambda *_: stop.set())


def run(args: argparse.Namespace) -> int:
    """`r3flow train ARGS`; returns the exit code."""
    return train(load(args))


def train(cfg) -> int:
    """Train from the store with `cfg.backend` until `run.steps` or SIGTERM; the exit code."""
    from prometheus_client import CollectorRegistry

    from services.common.auth import ClientAuth
    from services.common.metrics import MetricsServer, create_metrics
    from services.store.client import StoreClient
    from trainer.hooks import load_hooks
    from trainer.loop.loop import TrainLoop
    from trainer.loop.presence import TrainerPresence
    from trainer.loop.tracking import open_trackers
    from trainer.weight_push import StoreWeightPush

    hooks = load_hooks(cfg.hooks)  # a bad hook fails here, before the ranks start
    trackers = open_trackers(cfg.tracking, Path(cfg.run.run_dir))  # a missing package too
    stop = threading.Event()
    _stop_on_sigterm(stop)
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "trainer")
    server = MetricsServer(registry, cfg.run.metrics_host, cfg.run.metrics_port).start()
    log.info("trainer metrics on %s", server.url)
    try:
        auth = ClientAuth.from_config(cfg.data.store_auth)
        with StoreClient(cfg.data.store, auth=auth) as client:
            client.wait_ready(cfg.run.store_ready_timeout_s)
            # present from here to the exit: rollout workers generate while a trainer is
            with TrainerPresence(client, cfg.data.consumer) as presence:
                ranks = _ranks(cfg)
                _stop_on_sigterm(stop)  # again: ray.init installs its own handler
                push = (StoreWeightPush(
                    client, metrics.get("r3flow_trainer_weight_push_failures_total"))
                    if cfg.run.push_weights_every else None)
                loop = TrainLoop(cfg, ranks, client, metrics, push_fn=push, hooks=hooks,
                                 trackers=trackers)
                loop.resume()
                presence.run_id = loop.pos.run_id
                history = loop.run(cfg.run.steps, stop=stop.is_set)
        stop.wait(cfg.run.metrics_linger_s)  # the final values, for one more scrape
    finally:
        server.stop()
        for t in trackers:
            t.close()
    log.info("trained %d steps (%s backend); policy version %d", len(history), cfg.backend,
             loop.pos.policy_version)
    return 0
