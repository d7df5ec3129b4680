"""The megatron-core backend: GPTModel (MoE) with native RouterReplay, megatron DDP + Adam, the
megatron <-> HF weight mapping and the CPU shims megatron needs off-GPU."""
