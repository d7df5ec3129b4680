"""Replay-aware dispatch (model.planned_dispatch, issue 30) on two EP=2 ranks over gloo (real
megatron-core, CPU): the same r2 and r3 steps (MoE recompute on) with and without the plan,
bit for bit, and with model.moe_permute: gather too (issue 55: the gather-based permute /
unpermute, equal to fp32 rounding); no MoE layer falls back to megatron's per-layer split-size sync under r3; replay
ids changed after the plan was made raise the desync error on every rank (no hang); invalid
replay ids on one rank raise there and RankFailed on its peer, with and without the plan (no
hang).

The test runs this file as a script once per rank; each rank writes its results as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.ranks import run_script_ranks

pytestmark = pytest.mark.timeout(240)


def _run_ranks(tmp_path, model) -> list[dict]:
    return run_script_ranks(__file__, tmp_path, [str(model)])


def test_planned_dispatch_steps_equal_unplanned_and_a_stale_plan_raises(tmp_path):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    res = _run_ranks(tmp_path, model)
    for r in res:
        for key in ("loss_r2", "grad_norm_r2", "loss_r3", "grad_norm_r3"):
            assert r["planned"][key] == r["plain"][key], key  # bit for bit
        assert r["weights_equal"]
        # the gather permute: the same steps to fp32 rounding (its sums run in another order)
        for key in ("loss_r2", "grad_norm_r2", "loss_r3", "grad_norm_r3"):
            assert r["gather"][key] == pytest.approx(r["plain"][key], rel=1e-6, abs=1e-7), key
        assert r["gather_weights_diff"] < 1e-6
        assert r["gather_r3_dispatch"]["fallbacks"] == 0
        assert r["agreement_r3"] == 1.0
        # r3: the old-policy pass, the update and its MoE recompute all planned
        assert r["r3_dispatch"]["fallbacks"] == 0
        assert r["r3_dispatch"]["planned"] > 0
        assert r["plain_planned"] == 0  # the plain model has no planned layers
    assert res[0]["planned"]["grad_norm_r3"] == res[1]["planned"]["grad_norm_r3"]
    # ids changed after planning on rank 0 only: the error there, the fault on rank 1
    assert res[0]["desync"][0] == "ReplayDesyncError"
    assert "dispatch plan" in res[0]["desync"][1]
    assert res[1]["desync"][0] == "RankFailed"
    assert "dispatch plan" in res[1]["desync"][1]
    # invalid replay ids on rank 0 only: checked on every rank before the pass's first
    # collective (the plan's gather, or the first all-to-all): the error there, RankFailed on
    # rank 1 naming it, no hang; with and without the plan
    for name in ("plain", "planned"):
        assert res[0]["invalid"][name][0] == "InvalidRoutingError", res[0]["invalid"]
        assert res[1]["invalid"][name][0] == "RankFailed", res[1]["invalid"]
        assert "invalid ids" in res[1]["invalid"][name][1]


# ---------------------------------------------------------------- worker (one per rank)
def _trainer(model_dir: str, planned: bool, permute: str = "megatron"):
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    return make_trainer(TrainerConfig(
        model_dir=model_dir, data={"micro_batch_size": 2}, optim={"lr": 1e-4},
        model={"expert_parallel": 2, "experts": "grouped", "recompute_moe": True,
               "planned_dispatch": planned, "moe_permute": permute}, replay={"check_agreement": True}))


def _counts(tr) -> dict[str, int]:
    from trainer.megatron.planned_dispatch import dispatch_counts, planned_layers

    planned, fallbacks = dispatch_counts(planned_layers(tr.backend.policy.module))
    return {"planned": planned, "fallbacks": fallbacks}


def _shift_replayed_ids(tr) -> None:
    """A router forward pre-hook that changes the replayed ids in place after the plan counted
    them (each id + 1 mod E: still K distinct valid ids per token, other experts)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def hook(router, _inputs):
        replay = router.router_replay
        if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            ids = replay.target_topk_idx
            ids.copy_((ids + 1) % router.config.num_moe_experts)
    for r in tr.backend.policy.routers:
        r.register_forward_pre_hook(hook)


def _invalid_routing_step(tr, samples: list, rank: int) -> list[str]:
    """An r3 step whose rollout routing holds an out-of-range expert id on rank 0 only: the
    error's type and message on this rank."""
    bad = copy.deepcopy(samples)
    if rank == 0:
        bad[0].routing_TLK[0, 0, 0] = tr.backend.num_experts
    try:
        tr.train_step(bad, "r3")
        return ["none", ""]
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        return [type(e).__name__, str(e)]


def _worker(model_dir: str, out_path: str) -> None:
    import faulthandler

    import torch
    from test_trainer_ep import _attach_recorded_routing, _samples

    faulthandler.dump_traceback_later(150, exit=True)  # a stranded collective fails, not hangs
    rank = int(os.environ["RANK"])
    trainers = {"plain": _trainer(model_dir, False), "planned": _trainer(model_dir, True),
                "gather": _trainer(model_dir, True, "gather")}
    samples = {name: _samples(rank) for name in trainers}
    out: dict = {name: {} for name in trainers}
    for name, tr in trainers.items():
        m = tr.train_step(samples[name], "r2")
        out[name] |= {"loss_r2": m["loss"], "grad_norm_r2": m["grad_norm"]}
    _attach_recorded_routing(trainers["plain"], samples["plain"])
    for other in ("planned", "gather"):
        for a, b in zip(samples["plain"], samples[other], strict=True):
            b.routing_TLK = a.routing_TLK.copy()
    before = _counts(trainers["planned"])
    before_gather = _counts(trainers["gather"])
    for name, tr in trainers.items():
        m = tr.train_step(samples[name], "r3")
        out[name] |= {"loss_r3": m["loss"], "grad_norm_r3": m["grad_norm"]}
        out["agreement_r3"] = m["routing_agreement"]
    after = _counts(trainers["planned"])
    out["r3_dispatch"] = {k: after[k] - before[k] for k in after}
    after = _counts(trainers["gather"])
    out["gather_r3_dispatch"] = {k: after[k] - before_gather[k] for k in after}
    out["plain_planned"] = sum(_counts(trainers["plain"]).values())
    ex = {name: tr.export_hf_state_dict() for name, tr in trainers.items()}
    out["weights_equal"] = all(torch.equal(ex["plain"][k], ex["planned"][k]) for k in ex["plain"])
    out["gather_weights_diff"] = max(float((ex["plain"][k] - ex["gather"][k]).abs().max())
                                     for k in ex["plain"])
    del trainers["gather"]
    if rank == 0:
        _shift_replayed_ids(trainers["planned"])
    try:
        trainers["planned"].train_step(samples["planned"], "r3")
        out["desync"] = ["none", ""]
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        out["desync"] = [type(e).__name__, str(e)]
    out["invalid"] = {name: _invalid_routing_step(tr, samples["plain"], rank)
                      for name, tr in trainers.items()}
    Path(out_path).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
