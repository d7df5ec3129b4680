"""The megatron-core trainer on a lent GPU machine (NCCL, no CPU shims): `pytest -m gpu`.

Carry the megatron-core wheel; vLLM is not available there, so rollout routing comes from HF
(forced or natural, as in tests/integration/test_trainer_megatron.py, whose helpers are reused)
or from a RECORD pass. Results (with the card's name) go to bench-results/trainer_gpu.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.ranks import run_script_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench-results" / "trainer_gpu.json"
# model.* fields every trainer here takes (the fast path: R3FLOW_GPU_MODEL='{"experts":
# "grouped", "attention": "sdpa"}'; scripts/gpu_run.sh fastpath-tests sets it)
# Unset: the reference path, explicitly (the model switches default to auto, which is the fast
# path on CUDA bf16: issue 42)
FAST = json.loads(os.environ.get("R3FLOW_GPU_MODEL", "null")) or {
    "experts": "sequential", "attention": "unfused", "planned_dispatch": False,
    "batch_first_logits": False}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _load("trainer_cpu_tests", REPO / "tests/integration/test_trainer_megatron.py")


def _record(key: str, value) -> None:
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data[key] = value
    data["device"] = torch.cuda.get_device_name(0)
    data["gpus"] = torch.cuda.device_count()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=3,
                                                                        first_k_dense=1))


@pytest.fixture(scope="module")
def hf(model_dir):
    return H.load_hf(model_dir)


def _trainer(model_dir, **model):
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    return make_trainer(TrainerConfig(model_dir=str(model_dir), model=model | FAST,
                                      optim={"lr": 1e-6},
                                 data={"micro_batch_size": 4}, replay={"agreement_floor": 0.9}))


def test_gpu_r3_replays_rollout_routing_and_matches_hf(model_dir, hf):
    tr = _trainer(model_dir)
    mbs = tr.prepare(H.make_samples(hf, routing="random", seed=1))
    calls, handles = H.capture_routing(tr)
    try:
        lps = tr.compute_logprobs(mbs, "r3")
    finally:
        for h in handles:
            h.remove()
    from trainer.samples.alignment import to_router_rows

    for j, mb in enumerate(mbs):
        want = [r.sort(-1).values for r in to_router_rows(mb.routing_BSLK)]
        assert all(torch.equal(calls[2 * j + m][2].cpu(), want[m].cpu()) for m in range(2))
        diff = (lps[j] - mb.old_logprobs_BS).abs()[mb.loss_mask_BS.bool()]
        assert diff.max() < 2e-3
    natural = tr.old_policy_pass(tr.prepare(H.make_samples(hf, seed=2)), "r3")
    assert natural["routing_agreement"] > 0.99
    _record("fp32_r3_max_lp_diff_vs_hf", float(max((lp - mb.old_logprobs_BS).abs()[
        mb.loss_mask_BS.bool()].max() for lp, mb in zip(lps, mbs, strict=True))))


def _attach_recorded_routing(tr, samples) -> None:
    mbs = tr.prepare(samples)
    tr.compute_logprobs(mbs, "r2")
    for mb in mbs:
        b, s = mb.tokens_BS.shape
        rows = torch.stack(mb.replay_rows, 1).cpu()
        rows = rows.view(s, b, *rows.shape[1:]).transpose(0, 1)
        for j, x in enumerate(mb.samples):
            x.routing_TLK = rows[j, :x.tokens.size - 1].numpy()


def test_gpu_bf16_step_time_r3_vs_off(model_dir, hf):
    tr = _trainer(model_dir, dtype="bf16")
    samples = H.make_samples(hf, n=16, seed=3, groups=8)
    _attach_recorded_routing(tr, samples)
    times = {"off": [], "r3": []}
    for i in range(11):
        for mode in ("off", "r3"):
            m = tr.train_step(samples, mode)
            if i:
                times[mode].append(m["step_seconds"])
    ratio = statistics.median(times["r3"]) / statistics.median(times["off"])
    _record("bf16_step_seconds", {k: statistics.median(v) for k, v in times.items()})
    _record("replay_overhead_ratio", ratio)
    assert ratio < 1.5  # target 1.05: recorded in the JSON, asserted loosely (tiny model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_ranks_ep2(tmp_path, model_dir):
    worker = REPO / "tests/integration/test_trainer_ep.py"
    mode = ["grouped"] if FAST.get("experts") == "grouped" else []
    res = run_script_ranks(worker, tmp_path, [str(model_dir), *mode], gpu=True, timeout=600,
                           threads=None, name="r{rank}.json")
    assert all(r["export_exact"] and r["agreement_r3"] == 1.0 for r in res)
    assert res[0]["grad_norm_r3"] == pytest.approx(res[1]["grad_norm_r3"], rel=1e-5)
    _record("ep2_grad_norms", [r["grad_norm_r3"] for r in res])
    _record("model", FAST)
    assert np.isfinite(res[0]["grad_norm_r2"])
