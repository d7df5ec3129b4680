"""Checkpoints a restarted trainer resumes from: model, optimizer, data position, policy version.

Layout under `<run_dir>/checkpoints/`:
  step_000012/model_rank0.safetensors   this rank's parameters (RankWeights; the megatron
                                        backend's: megatron names, local experts)
  step_000012/optim_rank0.pt            megatron optimizer state_dict (Adam moments, step)
  step_000012/optim_params_rank0.pt     with the distributed optimizer: this rank's shard of the
                                        fp32 main weights and Adam moments (its state_dict has
                                        neither)
  step_000012/dcp/                      instead of the two above, a ShardedState (hf backend):
                                        torch.distributed.checkpoint of model + optimizer
  step_000012/meta.json                 step, policy version, data position (rank 0 writes)
  latest                                name of the newest complete checkpoint (rank 0, atomic)
Shards: every rank writes only its own parameters and optimizer state (its local experts and its
copy of the dense layers); no rank gathers another's. Without Megatron's distributed optimizer
the dense layers' state is still replicated across data-parallel ranks (see `r3flow plan`).
A ShardedState checkpoint (DCP) is resharded on load: it resumes on any world size (each rank
reads the pieces of its own shards), where the per-rank files resume only on the world that
wrote them.
Retention (`keep`): after `latest` moves, rank 0 removes all but the newest `keep` complete
checkpoints, never the one `latest` names or the one this run resumed from. A checkpoint is
first renamed to `.deleting-<name>` (atomic), then removed, so a crash mid-delete never leaves a
half-deleted directory that looks like a checkpoint.
Asynchronous saves (`background=True`, run.async_checkpoint): at the step boundary the rank copies
its weights and optimizer state into host buffers (pinned, kept from one save to the next:
trainer.checkpoint_snapshot) and a writer thread writes the files while training goes on;
`finish()` (every step boundary, all ranks) publishes the checkpoint once every rank's writer is
done: meta.json, then `latest`, exactly as a synchronous save does. A kill mid-write leaves a step directory without meta.json, which is never
resumed from (the last complete checkpoint is): the same crash consistency as a synchronous save.
Only the per-rank files go in the background; a ShardedState (DCP) saves synchronously.
Data position: the delivery ids acked after this checkpoint and the group ids trained so far
(bounded), so a group the store redelivers after a crash is recognised and not trained twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint_snapshot import HostSnapshot, write_files

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_DELETING = ".deleting-"


@dataclass
class DataPosition:
    """What the trainer has consumed."""

    step: int = 0
    policy_version: int = 0
    acked_delivery_ids: list[str] = field(default_factory=list)
    trained_group_ids: list[str] = field(default_factory=list)
    # the training run (run fencing, docs/store.md): made by a fresh run, kept by its resumes
    run_id: str = ""

    def remember(self, group_ids: list[str], keep: int = 10000) -> None:
        self.trained_group_ids = (self.trained_group_ids + list(group_ids))[-keep:]


def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    assert m, path
    return int(m.group(1))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _sharded_optimizers(optimizer: Any) -> list[Any]:
    """The megatron distributed optimizers inside `optimizer` (a ChainedOptimizer or one)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in parts if hasattr(o, "get_parameter_state_dp_zero")]


def _sharded_optimizer(optimizer: Any) -> bool:
    """Megatron's distributed optimizer: its parameter state is saved apart from state_dict."""
    return bool(_sharded_optimizers(optimizer))


def _shard_states(optimizer: Any) -> list[dict[str, Any]]:
    """Per distributed optimizer, this rank's shard: the inner torch optimizer's state (Adam
    moments, step) and its parameters, the fp32 main weights of this rank's slice."""
    return [{"inner": o.optimizer.state_dict(),
             "main": [p.detach().clone() for g in o.optimizer.param_groups for p in g["params"]]}
            for o in _sharded_optimizers(optimizer)]


def _load_shard_states(optimizer: Any, states: list[dict[str, Any]]) -> None:
    """Inverse of `_shard_states` on the same world (the per-rank files' contract)."""
    parts = _sharded_optimizers(optimizer)
    if len(states) != len(parts):
        raise ValueError(f"checkpoint: {len(states)} optimizer shards saved, {len(parts)} here")
    for o, st in zip(parts, states, strict=True):
        mains = [p for g in o.optimizer.param_groups for p in g["params"]]
        if [tuple(p.shape) for p in mains] != [tuple(t.shape) for t in st["main"]]:
            raise ValueError("checkpoint: the distributed optimizer's shards differ from the "
                             "saved ones (another world size or layout)")
        o.optimizer.load_state_dict(st["inner"])
        with torch.no_grad():
            for p, t in zip(mains, st["main"], strict=True):
                p.copy_(t)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _all_ranks(flag: bool) -> bool:
    """`flag` on every rank (one all-reduce; this rank's flag alone without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _remove(dirs: list[Path]) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


class ShardedState(ABC):
    """A backend's model + optimizer state saved with torch.distributed.checkpoint (DCP): every
    rank writes its own shards of one checkpoint; DCP reshards them to the loading world. A
    backend subclasses it (trainer.hf.engine.HFTrainState); the manager tells it apart from a
    plain module by this type."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RankWeights:
    """A module whose weights every rank saves to its own file (model_rank<r>.safetensors): a
    plain module's named parameters. A backend with other weights or names subclasses it
    (trainer.megatron.weights.MegatronWeights: the routers' bias buffers, grouped experts)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def weights(self) -> dict[str, torch.Tensor]:
        """Name -> tensor of every weight this rank saves."""
        return dict(self.module.named_parameters())

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` into the weights (exactly the names `weights()` gives)."""
        params = self.weights()
        if set(tensors) != set(params):
            raise ValueError(f"checkpoint: weights missing {sorted(set(params) - set(tensors))[:4]}"
                             f", unexpected {sorted(set(tensors) - set(params))[:4]}")
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)


def _rank_weights(module: Any) -> RankWeights:
    return module if isinstance(module, RankWeights) else RankWeights(module)


class CheckpointManager:
    """Save/resume for one trainer rank (every rank calls save/load/finish; rank 0 writes meta
    and prunes); `keep` = how many complete checkpoints to keep (0 = all); `background`: the
    files are written by a thread from a host snapshot (module docstring)."""

    def __init__(self, run_dir: str | Path, keep: int = 0, background: bool = False) -> None:
        if keep < 0:
            raise ValueError(f"run.keep_checkpoints: {keep} < 0")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.background = background
        self.resumed_from: Path | None = None
        self._snapshot = HostSnapshot()
        self._writer: threading.Thread | None = None
        self._pending: tuple[Path, DataPosition] | None = None
        self._error: BaseException | None = None
        self._reserving: threading.Thread | None = None
        self._cleanup: list[threading.Thread] = []

    @property
    def reserved(self) -> bool:
        """The host buffers of a background save are allocated (or being allocated)."""
        return self._reserving is not None

    def reserve(self, module: Any, optimizer) -> None:
        """Background saves: allocate the snapshot's pinned host buffers now, in a thread (the
        first save would otherwise spend seconds pinning memory on the step: 7 s for the 0.73 B
        model + Adam on the H200); call after the first update (the optimizer has its state)."""
        if not self.background or self.reserved or isinstance(module, ShardedState):
            return
        files = self._rank_files(module, optimizer, _rank(), snapshot=False)
        self._reserving = threading.Thread(target=self._snapshot.reserve, args=(files,),
                                           name="checkpoint-reserve", daemon=True)
        self._reserving.start()

    def latest(self) -> Path | None:
        ptr = self.root / "latest"
        if not ptr.is_file():
            return None
        path = self.root / ptr.read_text().strip()
        return path if (path / "meta.json").is_file() else None

    def save(self, module: Any, optimizer, pos: DataPosition) -> Path:
        """Write this rank's shard of `module` (a ShardedState, RankWeights or plain module);
        rank 0 writes meta and flips `latest` after all ranks. In the background: returns once
        the host snapshot is taken (a previous save still writing is waited for first);
        `finish()` publishes it."""
        rank, path = _rank(), self.root / f"step_{pos.step:06d}"
        self.finish(block=True)
        if (path / "meta.json").is_file() and not isinstance(module, ShardedState):
            # this step's checkpoint is complete already (a run's final save repeating its
            # periodic one: the same weights): only its data position is brought up to date,
            # its files are never rewritten in place (a kill then would tear a good one)
            self._publish(path, pos)
            return path
        path.mkdir(parents=True, exist_ok=True)
        if isinstance(module, ShardedState):
            import torch.distributed.checkpoint as dcp  # seconds to import: hf backend only

            # overwrite: the final save of a run may repeat the step's periodic one
            dcp.save({"train": module},
                     storage_writer=dcp.FileSystemWriter(str(path / "dcp"), overwrite=True))
            self._publish(path, pos)
            return path
        if self._reserving is not None:
            self._reserving.join()  # long done by the first checkpoint step
        files = self._rank_files(module, optimizer, rank)
        self._pending = (path, pos)
        if not self.background:
            write_files(path, files)
            self.finish(block=True)
            return path
        self._writer = threading.Thread(target=self._write, args=(path, files),
                                        name=f"checkpoint-{path.name}", daemon=True)
        self._writer.start()
        return path

    def _rank_files(self, module: Any, optimizer, rank: int, snapshot: bool = True
                    ) -> dict[str, Any]:
        """File name -> what goes in it; in the background, host copies taken now (unless
        not `snapshot`: the live tensors, for `reserve`)."""
        weights = _rank_weights(module).weights()
        if not self.background:  # own storage per tensor: safetensors refuses shared ones
            weights = {k: v.detach().contiguous().clone() for k, v in weights.items()}
        files = {f"model_rank{rank}.safetensors": weights,
                 f"optim_rank{rank}.pt": optimizer.state_dict()}
        if _sharded_optimizer(optimizer):
            files[f"optim_params_rank{rank}.pt"] = _shard_states(optimizer)
        return self._snapshot.take(files) if self.background and snapshot else files

    def _write(self, path: Path, files: dict[str, Any]) -> None:
        try:
            write_files(path, files)
        except BaseException as e:  # noqa: BLE001 - re-raised by finish() on the loop's thread
            self._error = e

    def finish(self, block: bool = False) -> Path | None:
        """Publish the save in flight once every rank has written its files (all ranks call it
        at the same boundary); with `block`, wait for this rank's writer. Returns the published
        checkpoint, or None (nothing pending, or a writer still busy)."""
        if self._pending is None:
            return None
        writer = self._writer
        if writer is not None and block:
            t0 = time.perf_counter()
            writer.join()
            if time.perf_counter() - t0 > 1.0:
                log.info("checkpoint %s: waited %.1f s for its writer", self._pending[0].name,
                         time.perf_counter() - t0)
        if not _all_ranks(writer is None or not writer.is_alive()):
            return None
        if self._error is not None:
            err, self._error, self._pending = self._error, None, None
            raise RuntimeError(f"checkpoint: the background write failed: {err}") from err
        (path, pos), self._pending, self._writer = self._pending, None, None
        self._publish(path, pos)
        return path

    def _publish(self, path: Path, pos: DataPosition) -> None:
        """After every rank's files: rank 0 writes meta.json and moves `latest` (atomic)."""
        _barrier()
        if _rank() == 0:
            (path / "meta.json").write_text(json.dumps(asdict(pos)))
            tmp = self.root / "latest.tmp"
            tmp.write_text(path.name)
            os.replace(tmp, self.root / "latest")
            self.prune()
        _barrier()

    def prune(self) -> list[Path]:
        """Remove checkpoints beyond the newest `keep` (never `latest`'s nor the resumed one)."""
        self._cleanup = [t for t in self._cleanup if t.is_alive()]
        # a crash mid-delete left these (none while a removal of ours is still running)
        leftovers = [] if self._cleanup else list(self.root.glob(f"{_DELETING}*"))
        latest = self.latest()
        if not self.keep or latest is None:
            _remove(leftovers)
            return []
        # Only directories up to latest: a newer one may be a save in progress. An older one
        # without meta.json is a save a crash interrupted (never resumable): removed too.
        older = [p for n, p in self._step_dirs() if n <= _step_of(latest)]
        complete = [p for p in older if (p / "meta.json").is_file()]
        keep = {*complete[-self.keep:], latest, self.resumed_from}
        removed = [p for p in older if p not in keep]
        doomed = [p.with_name(_DELETING + p.name) for p in removed]
        for p, d in zip(removed, doomed, strict=True):
            os.replace(p, d)
        if self.background:  # gigabytes to unlink: off the step (a crash leaves .deleting-*)
            self._cleanup.append(threading.Thread(target=_remove, args=(leftovers + doomed,),
                                                  daemon=True, name="checkpoint-prune"))
            self._cleanup[-1].start()
        else:
            _remove(leftovers + doomed)
        if removed:
            log.info("checkpoints: removed %s (keeping %d)", [p.name for p in removed], self.keep)
        return removed

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) of every step_N directory, oldest first."""
        return sorted((_step_of(p), p) for p in self.root.iterdir()
                      if _STEP_DIR.match(p.name) and p.is_dir())

    def load(self, module: Any, optimizer, path: Path | None = None) -> DataPosition:
        """Restore this rank's shard and the optimizer; returns the saved data position."""
        from safetensors.torch import load_file

        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"checkpoint: nothing to resume under {self.root}")
        if isinstance(module, ShardedState) != (path / "dcp").is_dir():
            raise ValueError(f"backend: checkpoint {path} was written by the other backend "
                             f"({'per-rank files' if isinstance(module, ShardedState) else 'DCP'})")
        if isinstance(module, ShardedState):
            import torch.distributed.checkpoint as dcp

            dcp.load({"train": module}, checkpoint_id=str(path / "dcp"))
        else:
            rank = _rank()
            _rank_weights(module).load_weights(
                load_file(str(path / f"model_rank{rank}.safetensors")))
            state = torch.load(path / f"optim_rank{rank}.pt", weights_only=False)
            optimizer.load_state_dict(state)
            if _sharded_optimizer(optimizer):
                # the distributed optimizer's state_dict holds no parameter state: its fp32
                # main weights and Adam moments (left as uninitialised placeholders by
                # load_state_dict) come from the parameter-state file of the same world
                params = path / f"optim_params_rank{rank}.pt"
                if not params.is_file():
                    raise FileNotFoundError(
                        f"checkpoint {path}: {params.name} missing (written before the "
                        "distributed optimizer's parameter state was saved); resuming from it "
                        "would train on uninitialised optimizer state")
                _load_shard_states(optimizer, torch.load(params, weights_only=False))
        self.resumed_from = path
        return DataPosition(**json.loads((path / "meta.json").read_text()))
