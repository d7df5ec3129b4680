"""OLMoE end to end: vLLM-CPU capture, HF and megatron backends (tests/integration/family_chain).

OLMoE brings softmax top-k without renormalisation and QK-norm over the whole q/k projection; on
megatron-core 0.19 the layer spec puts full-width norms in SelfAttention's q/k layernorm slots
(trainer/megatron/family_olmoe.py). The exported weights vLLM runs are the megatron trainer's.
"""

from __future__ import annotations

import json

import pytest
from family_chain import (
    build_chain,
    check_capture_equals_hf,
    check_greedy_equals_hf,
    check_trainer_r3_equals_hf_forced,
)

pytestmark = pytest.mark.timeout(900)
FAMILY = "olmoe"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp(FAMILY), FAMILY, export_backend="megatron")


def test_vllm_capture_equals_hf_router_choice_teacher_forced(chain):
    assert check_capture_equals_hf(chain) == 1.0


def test_megatron_export_loads_into_vllm_and_greedy_equals_hf(chain):
    check_greedy_equals_hf(chain)


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_trainer_r3_logprobs_equal_hf_forced_fp32(chain, backend):
    m = check_trainer_r3_equals_hf_forced(chain, backend)
    print(json.dumps({"family": FAMILY, "backend": backend, "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


def test_parallel_layouts_match_one_rank(tmp_path):
    """TP2+SP (the full-width QK-norm's sum of squares all-reduced over TP), PP2 and EP2 (2 gloo
    ranks) against 1 rank on a 4-layer olmoe: r3 logprobs before and after a step and the grad
    norm within tolerance, every router used the replayed ids, and each layout's HF export is
    the checkpoint."""
    from test_trainer_parallel import LAYOUTS, TOL, compare, run_layouts

    from services.rollout.families import build_family
    from services.rollout.tiny_moe import TinyMoeConfig

    model_dir = build_family(tmp_path / "model", FAMILY, TinyMoeConfig(num_layers=4))
    ref = run_layouts(tmp_path / "ref", model_dir, {"ref": (1, {}, {})})["ref"][0]
    names = ("tp2_sp", "pp2", "ep2")
    got = run_layouts(tmp_path / "layouts", model_dir, {n: LAYOUTS[n] for n in names})
    for name in names:
        res = compare(ref, got[name], TOL)
        print(json.dumps({"family": FAMILY, "layout": name} | res))
        assert res["ok"] and all(r["export_exact"] for r in got[name]), (name, res)
