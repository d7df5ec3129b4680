"""Megatron-core trainer: batch source, routing alignment, replay, GRPO/PPO loss, weight push.

Layers point down (docs/trainer.md; tests/unit/test_import_graph.py): configs and data
types (config, batch, alignment, replay) <- the backend protocol and shared maths (protocol,
collectives, loss) <- the step (grpo) <- the backends (megatron/, hf/) <- the factory (backend)
<- one rank (worker, weight_push) <- the loop, rank transports and CLI (loop/, ray_launch,
local_ranks, cli).
"""
