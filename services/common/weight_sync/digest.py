"""Tensor digests: the end-to-end check that what a rollout engine loaded is what the trainer
exported (both sides write `HF name -> digest` files that the tests and the cluster check
compare). Below both the trainer and the rollout worker extension, which each compute them."""

from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """'dtype:shape:sha256 of the bytes' of one tensor (comparable across processes)."""
    t = tensor.detach().contiguous().cpu().reshape(-1)
    sha = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return f"{str(t.dtype).removeprefix('torch.')}:{list(tensor.shape)}:{sha}"
