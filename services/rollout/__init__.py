"""Rollout service: vLLM engine with routing capture, agent loop, store streaming (docs/rollout.md)."""
