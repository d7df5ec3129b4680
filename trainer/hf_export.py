"""HF-format exports of the trained weights, for evaluation and serving (vLLM, transformers).

The trainer's checkpoints are per-rank Megatron shards that only the trainer can load; every
`run.hf_export_every` steps rank 0 also writes the full HF-named weights (the same state dict
the weight push sends) as a directory `from_pretrained` and vLLM load:
  <run_dir>/hf/step-12/model-00001-of-00002.safetensors   shards of at most `max_shard_bytes`
  <run_dir>/hf/step-12/model.safetensors.index.json       tensor name -> shard
  <run_dir>/hf/step-12/config.json, tokenizer files ...   copied from the run's model_dir
  <run_dir>/hf/latest -> step-12                          relative symlink, swapped atomically
Atomicity: a directory is written as `.tmp-step-N`, every file and the directory fsynced, then
renamed to `step-N`; `latest` is a new symlink made under a temporary name and moved over the
old one with os.replace, so a reader of `latest` sees a complete export or the previous one,
never a partial one. Retention (`keep`): all but the newest `keep` exports are removed (renamed
to `.deleting-*` first), never the one `latest` names; 0 keeps all.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP, _DELETING, _LATEST = ".tmp-", ".deleting-", "latest"
INDEX = "model.safetensors.index.json"
# Copied from model_dir next to the weights: configs, tokenizer, chat template. Weights and
# their index never are (the export has its own).
_COPY_SUFFIXES = (".json", ".txt", ".jinja", ".model", ".tiktoken")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename-then-delete, so a crash mid-delete leaves `.deleting-*`, never a partial export."""
    doomed = path.with_name(_DELETING + path.name)
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def shard_names(weights: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


class HFExport:
    """Writes `<run_dir>/hf/step-N` exports and the `latest` symlink (rank 0 only)."""

    def __init__(self, run_dir: str | Path, model_dir: str | Path, keep: int = 0,
                 max_shard_bytes: int = 5 << 30) -> None:
        if keep < 0:
            raise ValueError(f"run.hf_keep: {keep} < 0")
        self.root = Path(run_dir) / "hf"
        self.model_dir = Path(model_dir)
        self.keep, self.max_shard_bytes = keep, max_shard_bytes

    def latest(self) -> Path | None:
        """The export `latest` names (None before the first)."""
        link = self.root / _LATEST
        return self.root / os.readlink(link) if link.is_symlink() else None

    def write(self, weights: Mapping[str, torch.Tensor], step: int) -> Path:
        """Export `weights` as step `step`, point `latest` at it, prune; returns its directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step}"
        tmp = self.root / f"{_TMP}{final.name}"
        if tmp.exists():  # a crash mid-write of this same step
            shutil.rmtree(tmp)
        tmp.mkdir()
        self._write_weights(tmp, weights)
        self._copy_model_files(tmp)
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        if final.exists():  # re-exported after a resume from an earlier checkpoint
            _remove(final)
        os.replace(tmp, final)
        self._point_latest(final)
        self.prune()
        log.info("hf export: %s (%d tensors)", final, len(weights))
        return final

    def _write_weights(self, out: Path, weights: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        shards = shard_names(weights, self.max_shard_bytes)
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            part = {n: weights[n].detach().contiguous() for n in names}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(names, fname)
            total += sum(t.numel() * t.element_size() for t in part.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2))

    def _copy_model_files(self, out: Path) -> None:
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir: no config.json in {self.model_dir} to export with")
        for f in self.model_dir.iterdir():
            if (f.is_file() and f.name.endswith(_COPY_SUFFIXES)
                    and not f.name.endswith(_WEIGHT_SUFFIXES)):
                shutil.copyfile(f, out / f.name)

    def _point_latest(self, target: Path) -> None:
        tmp_link = self.root / f"{_TMP}{_LATEST}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(target.name, tmp_link)  # relative: valid wherever the volume is mounted
        os.replace(tmp_link, self.root / _LATEST)
        _fsync(self.root)

    def prune(self) -> list[Path]:
        """Remove exports beyond the newest `keep` (never `latest`'s) and crash leftovers."""
        for leftover in self.root.glob(f"{_DELETING}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in self.root.glob(f"{_TMP}step-*"):  # one writer: a crashed write
            shutil.rmtree(leftover, ignore_errors=True)
        latest = self.latest()
        if not self.keep:
            return []
        exports = sorted((int(m.group(1)), p) for p in self.root.iterdir()
                         if (m := _STEP_DIR.match(p.name)) and p.is_dir())
        removed = [p for _, p in exports[:-self.keep] if p != latest]
        for p in removed:
            _remove(p)
        if removed:
            log.info("hf exports: removed %s (keeping %d)", [p.name for p in removed], self.keep)
        return removed
