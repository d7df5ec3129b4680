"""Megatron-core trainer: batch source, routing alignment, replay, GRPO/PPO loss, weight push.

Layers point down (docs/trainer.md; tests/unit/test_import_graph.py): configs and data
types (config, samples/, replay) <- the backend protocol and shared maths (protocol,
ranks/collectives, losses/) <- the step (grpo) <- the backends (megatron/, hf/) <- the factory
(backend) <- one rank (ranks/worker, weight_push) <- the loop, rank transports and CLI (loop/,
ranks/ray_launch, ranks/local_ranks, cli).
"""
