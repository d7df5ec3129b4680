"""What a background checkpoint save (trainer.checkpoint, `background=True`) writes from: the host
snapshot of a rank's state taken at the step boundary, and the writer of that rank's files
(also used by a synchronous save)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def write_files(path: Path, files: dict[str, Any]) -> None:
    """This rank's files of one checkpoint: safetensors for the weights, torch.save else."""
    from safetensors.torch import save_file

    for name, state in files.items():
        if name.endswith(".safetensors"):
            save_file(state, str(path / name))
        else:
            torch.save(state, path / name)


class HostSnapshot:
    """Host copies of a state (nested dicts / lists of tensors), taken at a step boundary for a
    background writer. The buffers (pinned for CUDA tensors) are kept and reused by the next
    snapshot of the same structure: no allocation once warm; the caller makes sure the writer
    of the previous snapshot is done before taking the next."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def take(self, state: Any) -> Any:
        """`state` with every tensor replaced by its host copy (complete on return)."""
        self._next, cuda = 0, [False]
        out = self._copy(state, cuda)
        if cuda[0]:
            torch.cuda.synchronize()  # the non-blocking device->host copies have landed
        return out

    def reserve(self, state: Any) -> None:
        """Allocate the buffers a snapshot of `state` needs, copying nothing (pinning ~10 GB
        of host memory takes seconds: done ahead, off the step, by `CheckpointManager.reserve`)."""
        self._next = 0
        self._copy(state, [False], copy=False)

    def _copy(self, obj: Any, cuda: list[bool], copy: bool = True) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), cuda, copy)
        if isinstance(obj, dict):
            return {k: self._copy(v, cuda, copy) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._copy(v, cuda, copy) for v in obj)
        return obj

    def _tensor(self, t: torch.Tensor, cuda: list[bool], copy: bool = True) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        buf = self._buffers[i] if i < len(self._buffers) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[i:i + 1] = [buf]
        if copy:
            cuda[0] = cuda[0] or t.is_cuda
            buf.copy_(t, non_blocking=t.is_cuda)
        return buf
