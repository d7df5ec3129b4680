"""Colocated weight push by CUDA IPC (issue 57): when every engine of a plan runs on the
sender's own GPU (`r3flow local` on one GPU: the trainer and vLLM share it, and NCCL cannot join
two processes on one device), buckets go by CUDA IPC handle instead of a gloo/NCCL broadcast.

`IpcGroup` stands in for the push's process group and offers its one operation, `broadcast`:
rank 0 publishes the IPC handle of its bucket (torch's `reduce_tensor` args, as vLLM's
`vllm/distributed/weight_transfer/ipc_engine.py` sends them) under `ipc/{n}` of the push's
store; each receiver opens it (`rebuild_cuda_tensor`, cached by handle: a pool buffer is opened
once), copies it into its staging bucket on the GPU and writes `ipc/{n}/done/{rank}`; the
sender's broadcast completes when every member has copied, so the buffer is then free for the
next bucket. Everything else of the push is unchanged: headers, checksums, acks, commit, aborts.

The choice (`push_backend`) is made per plan from the members' registered GPU UUIDs; the sender
says it in one log line when it changes.
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.common.pb.r3flow.v1 import store_pb2

IPC = "ipc"


def gpu_uuid(index: int | None = None) -> str:
    """The UUID of CUDA device `index` (default: the current one); "" without CUDA."""
    if not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(
        torch.cuda.current_device() if index is None else index).uuid)


class _TorchOnly(pickle.Unpickler):
    """Unpickles a handle's args: torch's tensor, storage and dtype types, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"ipc handle: {module}.{name} is not a torch type")


def push_backend(configured: str, colocated_ipc: bool, sender_gpu: str,
                 members: Sequence[store_pb2.WorkerInfo]) -> tuple[str, str]:
    """(backend, why) of one push: CUDA IPC when allowed and every member is one engine rank
    on the sender's GPU; else the configured gloo/NCCL."""
    if not colocated_ipc:
        return configured, "weight_sync.colocated_ipc is off"
    if not sender_gpu:
        return configured, "the trainer holds no GPU"
    others = [m.worker_id for m in members
              if m.device_uuid != sender_gpu or max(1, m.world_size) != 1]
    if others:
        return configured, f"engine(s) {', '.join(others)} not on the trainer's GPU"
    return IPC, f"every engine on the trainer's GPU {sender_gpu}"


class _Work:
    """One IPC broadcast: completed on the sender when every member copied the bucket, on a
    receiver once it copied it (`wait(timeout)` raises RuntimeError when the slice runs out,
    as gloo's does: weight_sync.group.wait_work polls it in slices)."""

    def __init__(self, ready: Any, finish: Any = None) -> None:
        self._ready, self._finish, self._done = ready, finish, False

    def is_completed(self) -> bool:
        if not self._done and self._ready():
            if self._finish is not None:
                self._finish()
            self._done = True
        return self._done

    def wait(self, timeout: timedelta | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self.is_completed():
            if end is not None and time.monotonic() >= end:
                raise RuntimeError("ipc broadcast: not complete within the wait's slice")
            time.sleep(2e-4)
        return True


class IpcGroup:
    """A broadcast-only group over the push store for members on the sender's GPU."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self.store, self.rank, self.size, self.n = store, rank, size, 0
        self.aborted = False

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        (tensor,) = tensors
        key, self.n = f"ipc/{self.n}", self.n + 1
        done = [f"{key}/done/{r}" for r in range(1, self.size)]
        if self.rank == 0:
            from torch.multiprocessing.reductions import reduce_tensor

            torch.cuda.current_stream(tensor.device).synchronize()  # the pack has landed
            self.store.set(key, pickle.dumps(reduce_tensor(tensor)[1]))  # type: ignore[arg-type]  # c10d takes bytes

            def released() -> None:
                for k in [key, *done]:
                    self.store.delete_key(k)

            return _Work(lambda: self._check(done), released)

        def copy() -> None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            args = list(_TorchOnly(io.BytesIO(self.store.get(key))).load())
            args[6] = tensor.device.index  # the storage's device: this process's index
            tensor.copy_(rebuild_cuda_tensor(*args))
            torch.cuda.current_stream(tensor.device).synchronize()
            self.store.set(f"{key}/done/{self.rank}", "1")

        return _Work(lambda: self._check([key]), copy)

    def _check(self, keys: list[str]) -> bool:
        if self.aborted:
            raise RuntimeError("ipc broadcast: the group was aborted")
        return self.store.check(keys)

    def abort(self) -> None:
        self.aborted = True
