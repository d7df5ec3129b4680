"""An HF safetensors checkpoint read lazily, tensor by tensor (`safe_open`): the trainer's load
maps it name by name, so each rank reads only the tensors its pipeline stage and experts need,
and holds one unit (a decoder layer) at a time, never the model.

`LazyCheckpoint` is a read-only mapping HF name -> tensor over every `*.safetensors` file of the
directory (one file, or the shards an `index.json` lists, as `save_pretrained` writes them);
`bytes_read` counts what was read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """HF name -> tensor, each read from its file when asked for (not cached)."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        d = Path(hf_dir)
        index = d / INDEX
        if index.is_file():
            files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(d.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_dir: no *.safetensors under {d}")
        self._handles: dict[Path, Any] = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}
        self.bytes_read = 0
        self.tensors_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        t = self._handles[self._where[name]].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def total_bytes(self) -> int:
        """Bytes of every tensor of the checkpoint (its data, headers excluded)."""
        return sum(f.stat().st_size for f in self._handles)
