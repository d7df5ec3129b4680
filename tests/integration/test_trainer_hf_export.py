"""A short trainer run against a real store exports HF weights every step: `<run_dir>/hf/latest`
is what the eval job's vLLM engine loads, so transformers must load it from the local path with
no missing or unexpected weights, and its weights must equal the trainer's own HF export."""

from __future__ import annotations

import os

import pytest
import torch
from test_trainer_cli import _hf, make_group

pytestmark = pytest.mark.timeout(300)


def _checkpoint_named(model_dir) -> dict[str, torch.Tensor]:
    """HF weights as `from_pretrained` loads them, under checkpoint names (fused experts split)."""
    from transformers import AutoModelForCausalLM

    from trainer.hf.model import export_hf

    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return export_hf(hf, torch.float32)


def _ranks(backend: str, cfg):
    from trainer.ranks.local_ranks import LocalRanks

    return LocalRanks(cfg.model_copy(update={"backend": backend}))


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_short_run_exports_hf_latest_that_transformers_loads(tmp_path, store_process, backend):
    from transformers import AutoTokenizer

    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from services.store.client import StoreClient
    from trainer.config import TrainerConfig
    from trainer.loop.loop import TrainLoop

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    hf = _hf(model)
    run_dir = tmp_path / "run"
    cfg = TrainerConfig.model_validate({
        "model_dir": str(model), "optim": {"lr": 1e-3},
        "replay": {"mode": "r3", "agreement_floor": 0.9},
        "data": {"store": store_process.address, "groups_per_step": 1, "wait_ms": 5000,
                 "micro_batch_size": 2, "consumer": f"trainer-hf-export-{backend}"},
        "run": {"run_dir": str(run_dir), "checkpoint_every": 1, "push_weights_every": 0,
                "keep_checkpoints": 1, "hf_export_every": 1, "hf_keep": 1}})
    with StoreClient(store_process.address) as client:
        for g in range(2):
            for traj in make_group(hf, f"hf-export-{backend}-{g}", 2, seed=g):
                client.append_trajectory(traj)
        ranks = _ranks(backend, cfg)
        loop = TrainLoop(cfg, ranks, client)
        loop.resume()
        assert len(loop.run(2)) == 2
    # Both backends prune their checkpoints (run.keep_checkpoints) and their HF exports.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest",
                                                                           "step_000002"]
    root = run_dir / "hf"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2"]  # hf_keep 1
    assert os.readlink(root / "latest") == "step-2"

    want = ranks.worker.export_hf()  # what the weight push sends after step 2
    got = _checkpoint_named(str(root / "latest"))
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w.float(), rtol=0, atol=0, msg=name)
    base = _checkpoint_named(str(model))
    assert any(not torch.equal(base[k], want[k].float()) for k in want), "nothing trained"
    assert AutoTokenizer.from_pretrained(str(root / "latest")).vocab_size > 0


def test_ray_ep2_ranks_all_join_the_export_and_rank0_writes_it(tmp_path):
    """Two Ray actor ranks with expert parallel 2: the export gathers both ranks' experts (a
    collective: every rank takes part), only rank 0 writes, the result is the full model."""
    import ray
    from test_trainer_ray import ListStore, _groups

    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from trainer.config import TrainerConfig
    from trainer.loop.loop import TrainLoop
    from trainer.ranks.ray_launch import RayRanks

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    run_dir = tmp_path / "run"
    cfg = TrainerConfig(model_dir=str(model), model={"expert_parallel": 2},
                        replay={"mode": "r2"}, data={"groups_per_step": 2, "micro_batch_size": 2},
                        run={"launcher": "ray", "world_size": 2, "run_dir": str(run_dir),
                             "checkpoint_every": 1, "push_weights_every": 0,
                             "hf_export_every": 1})
    ranks = RayRanks(cfg, world_size=2)
    try:
        assert len(TrainLoop(cfg, ranks, ListStore(_groups(2))).run(1)) == 1
        want = ranks.call("export_hf", [(), ()])[0]
    finally:
        ranks.shutdown()
        ray.shutdown()
    assert os.readlink(run_dir / "hf" / "latest") == "step-1"
    got = _checkpoint_named(str(run_dir / "hf" / "latest"))
    assert set(got) == set(want) and any(".experts.7." in k for k in got)  # both ranks' experts
    for name, w in want.items():
        torch.testing.assert_close(got[name], w.float(), rtol=0, atol=0, msg=name)
