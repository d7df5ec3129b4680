"""Data faults decided on every rank together (issue 28), megatron-core on 2 gloo CPU ranks
(data-parallel): only rank 1 hits the fault, both ranks quarantine the same group, skip or
redo the same update and stay identical; neither crashes nor waits for the other.

  * OOM: rank 1's long trajectory runs out of memory in its update forward (simulated by a
    forward pre-hook raising torch.OutOfMemoryError on long training sequences): rank 0
    hears it at its vote before the grad reduction;
  * non-finite: rank 1's group has a NaN reward (its loss is NaN): the vote before the
    optimizer step skips the update on both ranks;
  * filler: rank 1 has no sample (filler micro-batches only): it reports ppo_kl / entropy
    None, so the reduced (logged) values are rank 0's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from trainer_fixtures import TINY, natural_samples

from services.common.net import free_port
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)
LONG = 32  # padded length of the micro-batch holding the long trajectory


def _oom_on_long(module, args, kwargs):
    if module.training and kwargs["input_ids"].shape[1] >= LONG:
        raise torch.OutOfMemoryError("simulated: CUDA out of memory on a long trajectory")


def _state(tr) -> dict:
    ps = [p.detach() for p in tr.backend.policy.module.parameters()]
    return {"checksum": float(sum(p.double().sum() for p in ps)),
            "finite": all(bool(torch.isfinite(p).all()) for p in ps)}


def _rank(rank, world, port, model_dir, shares, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    tr = make_trainer(TrainerConfig.model_validate(dict(
        model_dir=model_dir, data={"micro_batch_size": 2}, optim={"lr": 1e-3},
        replay={"agreement_floor": 0.5})))
    hook = tr.backend.policy.module.register_forward_pre_hook(_oom_on_long, with_kwargs=True)
    res = {}
    for name, share in shares[rank].items():
        m = tr.train_step(share)
        res[name] = {"dropped": m["dropped"], "trajectories": m.get("trajectories"),
                     "ppo_kl": m.get("ppo_kl"), "entropy": m.get("entropy"),
                     "grad_norm": m.get("grad_norm")} | _state(tr)
    hook.remove()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_a_fault_on_one_rank_is_quarantined_on_both(tmp_path):
    import torch.multiprocessing as mp

    from trainer.loop.metrics import reduce_metrics

    model_dir = build_tiny_moe(tmp_path / "m", TinyMoeConfig(num_layers=2, **TINY))
    r4 = [0.0, 1.0, 1.0, 0.0]
    nan = natural_samples(model_dir, r4, seed=3, prefix="n")
    nan[0].reward = float("nan")
    shares = [
        {"oom": natural_samples(model_dir, r4, seed=1, prefix="a"),
         "nan": natural_samples(model_dir, r4, seed=4, prefix="c"),
         "filler": natural_samples(model_dir, r4, seed=6, prefix="e")},
        {"oom": natural_samples(model_dir, r4, seed=2, prefix="b", lengths=[5, 5, 30, 5]),
         "nan": nan, "filler": []}]
    mp.spawn(_rank, args=(2, free_port(), str(model_dir), shares, str(tmp_path)), nprocs=2,
             join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["oom"]["dropped"] == r1["oom"]["dropped"] == {"b1": "oom"}
    assert r0["nan"]["dropped"] == r1["nan"]["dropped"] == {"n0": "non_finite"}
    for step in ("oom", "nan", "filler"):  # the replicas stay identical and finite
        assert r0[step]["checksum"] == r1[step]["checksum"] and r0[step]["finite"], step
        assert r0[step]["grad_norm"] == pytest.approx(r1[step]["grad_norm"], rel=1e-9)
    assert (r0["oom"]["trajectories"], r1["oom"]["trajectories"]) == (4, 2)
    assert r1["filler"]["ppo_kl"] is None and r1["filler"]["entropy"] is None
    logged = reduce_metrics([r0["filler"], r1["filler"]])
    assert logged["ppo_kl"] == r0["filler"]["ppo_kl"] and logged["entropy"] == r0["filler"]["entropy"]
    assert r0["filler"]["entropy"] > 0
