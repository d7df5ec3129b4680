"""The colocated weight push by CUDA IPC (issue 57) on a lent GPU: the trainer's sender in this
process, a receiver in another process on the same GPU (as vLLM's worker is); the plan picks
ipc from the receiver's registered GPU UUID; every tensor arrives bit-equal, twice (the second
push reuses the group and the opened handles). `pytest -m gpu tests/gpu/test_weight_push_ipc_gpu.py`
prints the push seconds of a 0.73 B-sized bf16 push (the r3flow local GPU model's bytes)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import WeightReceiver, WeightSender, WeightSyncConfig
from services.common.weight_sync.digest import tensor_digest
from services.common.weight_sync.ipc import gpu_uuid
from services.common.weight_sync.receiver_stream import stream_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]


def _receiver(plans, out) -> None:  # a spawned process: the engine's side
    rx = WeightReceiver("engine", device="cuda:0")
    out.put(gpu_uuid())
    while (raw := plans.get()) is not None:
        plan = store_pb2.WeightSyncPlan.FromString(raw)
        got = {n: tensor_digest(t) for n, t in stream_weights(rx, plan)}
        out.put(got)


def _weights(seed: int, layers: int = 8) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    named = []
    for i in range(layers):  # ~0.09 B parameters a layer: 64 experts x 3 x 1024 x 512 / 2
        for e in range(64):
            for kind, shape in (("gate_proj", (512, 1024)), ("up_proj", (512, 1024)),
                                ("down_proj", (1024, 512))):
                named.append((f"model.layers.{i}.mlp.experts.{e}.{kind}.weight",
                              torch.randn(shape, generator=g, device="cuda",
                                          dtype=torch.bfloat16)))
    return named


def test_ipc_push_is_chosen_and_bit_exact_across_processes():
    ctx = mp.get_context("spawn")
    plans, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(plans, out), daemon=True)
    proc.start()
    sender = WeightSender(WeightSyncConfig(timeout_s=60))
    try:
        member = store_pb2.WorkerInfo(worker_id="engine", host="127.0.0.1", world_size=1,
                                      device_uuid=out.get(timeout=120))
        seconds = []
        for version in (1, 2):
            named = _weights(version)
            plan = sender.plan(version, [member])
            assert plan.backend == "ipc"
            plans.put(plan.SerializeToString())
            report = sender.push(plan, named)
            got = out.get(timeout=120)
            assert got == {n: tensor_digest(t) for n, t in named}
            seconds.append(report.seconds)
        print(f"ipc push on {torch.cuda.get_device_name(0)}: {report.num_bytes / 1e6:.0f} MB "
              f"in {seconds[0]:.3f} s (first), {seconds[1]:.3f} s (second)")
    finally:
        plans.put(None)
        proc.join(timeout=30)
        sender.close()
