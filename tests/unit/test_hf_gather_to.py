"""trainer.hf.model.gather_to: a DTensor's full value on the sender only, gathered over the
shard group of the sender's replica (FSDP2 full sharding and HSDP), uneven shards included."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from services.common.net import free_port


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.hf.model import gather_to

    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)  # 7 rows: uneven shards
    got = {}
    flat = init_device_mesh("cpu", (4,))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for name, mesh, placements in [("full", flat, [Shard(0)]),
                                   ("hsdp", hsdp, [Replicate(), Shard(0)])]:
        for sender in (0, 3):
            value = gather_to(distribute_tensor(full, mesh, placements), sender, rank)
            got[f"{name}/{sender}"] = None if value is None else bool(torch.equal(value, full))
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def test_full_value_on_the_sender_only(tmp_path):
    mp.spawn(_rank, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for key in ("full/0", "full/3", "hsdp/0", "hsdp/3"):
        sender = int(key.split("/")[1])
        assert [g[key] for g in got] == [True if r == sender else None for r in range(4)], key
