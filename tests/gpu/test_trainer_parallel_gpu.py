"""Megatron parallel layouts with routing replay on a lent 4-GPU machine (NCCL): `pytest -m gpu`.

The equality test of tests/integration/test_trainer_parallel.py (its rank worker is reused) over
the issue-21 table: {1 GPU; TP2 (SP); PP2; CP2; EP2; TP2xEP2; PP2xEP2; EP2 + recompute;
DP2xEP2 with the distributed optimizer, also with its parameter all-gather overlapped}, one r3
batch with random rollout routing each:
  * fp32: per-token logprobs (before and after one step) and the step's grad norm equal the
    1-GPU fp32 reference within 1e-5; every router used exactly the rollout's experts;
  * bf16: the same against the 1-GPU bf16 reference, within twice what bf16 itself moves the
    1-GPU result away from fp32 (a layout may reorder bf16 reductions, which is worth at most
    about the rounding bf16 already adds; a misrouted row or a lost shard moves logprobs by
    far more), and the replayed experts exactly equal.
CP2 is skipped: megatron-core 0.19's local attention has no context parallelism and the device
has no TransformerEngine. Results go to bench-results/trainer_parallel_gpu.json (card named).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench-results" / "trainer_parallel_gpu.json"
TOL = 1e-5
BF16_FLOOR = 1e-3  # a bf16-vs-fp32 gap below this would make the bf16 bound meaninglessly tight


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _load("trainer_parallel_cpu", REPO / "tests/integration/test_trainer_parallel.py")
REC_FULL = {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}
TABLE: dict[str, tuple[int, dict, dict]] = {
    "tp2_sp": (2, {"tensor_parallel": 2, "sequence_parallel": True}, {}),
    "pp2": (2, {"pipeline_parallel": 2}, {}),
    "ep2": (2, {"expert_parallel": 2}, {}),
    "ep2_recompute_full": (2, {"expert_parallel": 2} | REC_FULL, {}),
    "ep2_recompute_moe": (2, {"expert_parallel": 2, "recompute_granularity": "selective",
                              "recompute_modules": ["moe"]}, {}),
    "tp2_ep2": (4, {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2}, {}),
    "pp2_ep2": (4, {"pipeline_parallel": 2, "expert_parallel": 2}, {}),
    "dp2_ep2_distopt": (4, {"expert_parallel": 2}, {"use_distributed_optimizer": True}),
    # the parameter all-gather left to the next forward (NCCL, async; expert DP 2 too; grouped
    # experts, which read child modules' weights, under fastpath-tests' R3FLOW_GPU_MODEL)
    "dp2_ep2_distopt_overlap": (4, {"expert_parallel": 2}, {
        "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "ddp_bucket_size": 20_000}),
}
DTYPES = ("fp32", "bf16")
# model.* fields of every layout and reference (the fast path: R3FLOW_GPU_MODEL='{"experts":
# "grouped", "attention": "sdpa"}'; scripts/gpu_run.sh fastpath-tests sets it)
# Unset: the reference path, explicitly (the model switches default to auto, which is the fast
# path on CUDA bf16: issue 42)
FAST = json.loads(os.environ.get("R3FLOW_GPU_MODEL", "null")) or {
    "experts": "sequential", "attention": "unfused", "planned_dispatch": False,
    "batch_first_logits": False}


def _with_dtype(table: dict, world: int) -> dict:
    return {f"{name}/{dt}": (w, m | {"dtype": dt} | FAST, o) for name, (w, m, o) in table.items()
            if w == world for dt in DTYPES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=4,
                                                                         first_k_dense=1))
    refs = {f"ref/{dt}": (1, {"dtype": dt} | FAST, {}) for dt in DTYPES}
    out = P.run_layouts(tmp_path_factory.mktemp("ref"), model, refs, gpu=True, timeout=300)
    for world in sorted({w for w, _, _ in TABLE.values()}):
        if torch.cuda.device_count() < world:
            continue
        out |= P.run_layouts(tmp_path_factory.mktemp(f"w{world}"), model,
                             _with_dtype(TABLE, world), gpu=True, timeout=400)
    return out


def _bf16_tolerance(results: dict) -> dict[str, float]:
    """Twice the 1-GPU bf16-vs-fp32 gap (floored), per quantity."""
    gap = P.compare(results["ref/fp32"][0], results["ref/bf16"], 0.0)
    return {k: max(2 * gap[k], BF16_FLOOR) for k in
            ("lp_max_diff", "lp_after_max_diff", "grad_norm_diff")} | {"bf16_vs_fp32": gap}


def _record(name: str, value) -> None:
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data[name] = value
    data["device"] = torch.cuda.get_device_name(0)
    data["gpus"] = torch.cuda.device_count()
    data["model"] = FAST
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [*TABLE, pytest.param("cp2", marks=pytest.mark.skip(
    reason=P.CP_SKIP))])
def test_gpu_layout_matches_one_gpu(results, name, dtype):
    world = TABLE[name][0]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ranks = results[f"{name}/{dtype}"]
    ref = results[f"ref/{dtype}"][0]
    res = P.compare(ref, ranks, TOL)
    tol = {k: TOL for k in ("lp_max_diff", "lp_after_max_diff", "grad_norm_diff")}
    if dtype == "bf16":
        tol = _bf16_tolerance(results)
    _record(f"{name}/{dtype}", res | {"tolerance": tol, "seconds": ranks[0]["seconds"]})
    assert res["replay_mismatch"] == 0 and res["replayed_rows"] > 0
    for key in ("lp_max_diff", "lp_after_max_diff", "grad_norm_diff"):
        assert res[key] <= tol[key], (key, res, tol)
    if "recompute" in name:
        assert all(r["recomputes"] == r["forwards"] and sum(r["forwards"]) > 0 for r in ranks)


def test_gpu_reference_bf16_is_bf16(results):
    """The bf16 reference differs from fp32 (else the bf16 tolerance would test nothing)."""
    gap = P.compare(results["ref/fp32"][0], results["ref/bf16"], 0.0)
    _record("ref/bf16_vs_fp32", gap)
    assert gap["lp_max_diff"] > 0 and np.isfinite(gap["grad_norm_diff"])
