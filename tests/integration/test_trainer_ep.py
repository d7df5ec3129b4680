"""Two trainer ranks with expert parallel 2 over gloo (2 processes, real megatron-core).

The test runs this file as a script once per rank; each rank writes its results as JSON.
Each rank: builds the EP=2 model from the HF checkpoint (4 of 8 experts per rank), checks the
gathered HF export equals the checkpoint, records its own routing (r2 pass), then takes an r2
step and an r3 step replaying that routing on its own data shard.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.ranks import run_script_ranks

pytestmark = pytest.mark.timeout(240)


def _run_ranks(tmp_path, model, mode: str) -> list[dict]:
    return run_script_ranks(__file__, tmp_path, [str(model), mode])


def test_two_ranks_ep2_step_with_identical_grad_norms(tmp_path):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    res = _run_ranks(tmp_path, model, "steps")
    assert all(r["export_exact"] for r in res)
    assert [r["local_experts"] for r in res] == [4, 4]
    for key in ("grad_norm_r2", "grad_norm_r3"):
        assert res[0][key] > 0
        assert res[0][key] == pytest.approx(res[1][key], rel=1e-6), key
    assert all(r["agreement_r3"] == 1.0 for r in res)
    assert res[0]["loss_r3"] != res[1]["loss_r3"]  # each rank trained on its own shard
    # the fast path's grouped experts (CPU: the reference loop over stacked weights) behind the
    # same all-to-all dispatcher: the same gradients bit for bit (test_megatron_fastpath); the
    # grad norm sums one stacked tensor instead of 8 (another order: 1e-9 relative), and its
    # clip coefficient moves the r3 step's weights by as much
    grouped = _run_ranks(tmp_path, model, "grouped")
    assert all(r["export_exact"] for r in grouped)
    assert all(r["agreement_r3"] == 1.0 for r in grouped)
    for key in ("grad_norm_r2", "grad_norm_r3", "loss_r3"):
        for r, g in zip(res, grouped, strict=True):
            assert g[key] == pytest.approx(r[key], rel=1e-7), key


def test_ep2_ranks_with_unequal_microbatch_counts_step_together(tmp_path):
    """Rank 0 holds 4 samples (2 micro-batches), rank 1 one sample, then none (its groups
    quarantined): with mini_batches=2 every pass and every update is still an all-to-all both
    ranks join. Each rank must pad to the busiest rank's micro-batch count (no hang, no
    mismatched collective) and padding must train nothing."""
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    res = _run_ranks(tmp_path, model, "uneven")
    assert [r["trajectories"] for r in res] == [[4, 4], [1, 0]]
    assert [r["padded"] for r in res] == [[0, 0], [1, 2]]
    for step in range(2):
        assert res[0]["grad_norm"][step] > 0
        assert res[0]["grad_norm"][step] == pytest.approx(res[1]["grad_norm"][step], rel=1e-6)
    assert res[1]["loss"][1] is None  # only padding on rank 1 in the r3 step: no metric
    assert all(r["policy_version"] == 2 for r in res)


# ---------------------------------------------------------------- worker (one per rank)
def _samples(rank: int):
    from trainer_fixtures import toy_samples

    return toy_samples(100 + rank)


def _attach_recorded_routing(trainer, samples) -> None:
    """Record the policy's routing (r2 pass) and store it as the samples' rollout routing."""
    import torch

    mbs = trainer.prepare(samples)
    trainer.compute_logprobs(mbs, "r2")
    for mb in mbs:
        b, s = mb.tokens_BS.shape
        rows_TLK = torch.stack(mb.replay_rows, 1)
        rows_BSLK = rows_TLK.view(s, b, *rows_TLK.shape[1:]).transpose(0, 1)
        for j, x in enumerate(mb.samples):
            x.routing_TLK = rows_BSLK[j, :x.tokens.size - 1].cpu().numpy()


def _worker(model_dir: str, out_path: str, experts: str = "sequential") -> None:
    import torch
    from safetensors.torch import load_file

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    rank = int(os.environ["RANK"])
    cfg = TrainerConfig(model_dir=model_dir, model={"expert_parallel": 2, "experts": experts},
                        data={"micro_batch_size": 2}, optim={"lr": 1e-4})
    tr = make_trainer(cfg)
    ref = load_file(str(Path(model_dir) / "model.safetensors"))
    exported = tr.export_hf_state_dict()
    exact = set(ref) == set(exported) and all(torch.equal(ref[k], exported[k].cpu()) for k in ref)
    samples = _samples(rank)
    r2 = tr.train_step(samples, "r2")
    _attach_recorded_routing(tr, samples)
    r3 = tr.train_step(samples, "r3")
    local = int(tr.backend.policy.module.decoder.layers[1].mlp.experts.num_local_experts)
    Path(out_path).write_text(json.dumps({
        "export_exact": exact, "local_experts": local, "grad_norm_r2": r2["grad_norm"],
        "grad_norm_r3": r3["grad_norm"], "agreement_r3": r3["routing_agreement"],
        "loss_r3": r3["loss"]}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _uneven_worker(model_dir: str, out_path: str) -> None:
    """r2 step on 4 vs 1 samples, then r3 on 4 vs 0 samples (mini_batches=2)."""
    import faulthandler

    import torch

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    faulthandler.dump_traceback_later(120, exit=True)  # a stranded collective fails, not hangs
    rank = int(os.environ["RANK"])
    cfg = TrainerConfig(model_dir=model_dir, model={"expert_parallel": 2},
                        data={"micro_batch_size": 2}, optim={"lr": 1e-4, "mini_batches": 2})
    tr = make_trainer(cfg)
    samples = _samples(rank)[:4 if rank == 0 else 1]
    r2 = tr.train_step(samples, "r2")
    samples = samples if rank == 0 else []
    _attach_recorded_routing(tr, samples)
    r3 = tr.train_step(samples, "r3")
    steps = (r2, r3)
    Path(out_path).write_text(json.dumps({
        "trajectories": [m["trajectories"] for m in steps],
        "padded": [m["microbatches_padded"] for m in steps],
        "grad_norm": [m["grad_norm"] for m in steps], "loss": [m["loss"] for m in steps],
        "policy_version": tr.policy_version}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[3:] == ["uneven"]:
        _uneven_worker(sys.argv[1], sys.argv[2])
    else:
        _worker(sys.argv[1], sys.argv[2], "grouped" if sys.argv[3:] == ["grouped"] else
                "sequential")
