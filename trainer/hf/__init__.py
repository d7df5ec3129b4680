"""HF transformers / FSDP2 trainer backend with routing replay through router forward hooks."""
