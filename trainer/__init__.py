"""Megatron-core trainer: batch source, routing alignment, replay, GRPO/PPO loss, weight push."""
