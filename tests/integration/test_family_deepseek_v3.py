"""DeepSeek-V3 (Moonlight, Kimi-K2) end to end: vLLM-CPU capture, HF and megatron backends
(tests/integration/family_chain).

DeepSeek-V3 brings MLA (megatron-core's MLASelfAttention, trainer.megatron.family_deepseek_v3), a
grouped sigmoid router whose e_score_correction_bias steers selection only (megatron's
expert_bias, held fixed), group-limited top-k, routed_scaling_factor, a shared expert and a leading
dense layer. The exported weights vLLM runs are the megatron trainer's.

vLLM-CPU 0.30 and MLA: with plain RoPE its CPU rotary kernel mis-rotates MLA's 3-D q_pe/k_pe views
(tokens differ from HF's from the first one); the tiny model ships YaRN as DeepSeek-V3 and Kimi-K2
do, which vLLM rotates in PyTorch, and the chain agrees. Plain-RoPE MLA checkpoints (Moonlight) are
refused at rollout-engine start on CPU, naming the kernel (services/rollout/mla_rope.py, with the
minimal reproduction; tests/unit/test_megatron_deepseek_v3.py).
"""

from __future__ import annotations

import json

import pytest
from family_chain import (
    build_chain,
    check_capture_equals_hf,
    check_export_equals_checkpoint,
    check_greedy_equals_hf,
    check_trainer_r3_equals_hf_forced,
)

pytestmark = pytest.mark.timeout(900)
FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp(FAMILY), FAMILY, export_backend="megatron")


def test_vllm_capture_equals_hf_router_choice_teacher_forced(chain):
    assert check_capture_equals_hf(chain) == 1.0


def test_megatron_export_is_the_checkpoint(chain):
    check_export_equals_checkpoint(chain)


def test_megatron_export_loads_into_vllm_and_greedy_equals_hf(chain):
    check_greedy_equals_hf(chain)


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_trainer_r3_logprobs_equal_hf_forced_fp32(chain, backend):
    m = check_trainer_r3_equals_hf_forced(chain, backend)
    print(json.dumps({"family": FAMILY, "backend": backend, "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


def test_hf_backend_export_is_the_checkpoint(chain, tmp_path):
    """The HF backend's export of the same checkpoint (what its weight push sends)."""
    from dataclasses import replace

    from family_chain import trainer_config

    from trainer.backend import make_trainer
    from trainer.hf_export import HFExport

    tr = make_trainer(trainer_config(chain.model_dir, "hf"))
    export = HFExport(tmp_path / "run", chain.model_dir).write(tr.backend.export_hf_state_dict(), 0)
    check_export_equals_checkpoint(replace(chain, export_dir=export))


# PP splits the MLA layers, EP the experts: each against one rank (test_trainer_parallel's
# check). TP is refused at boot for MLA (trainer.megatron.family_deepseek_v3.check_mla_layout).
PARALLEL = {"pp2": (2, {"pipeline_parallel": 2}, {}), "ep2": (2, {"expert_parallel": 2}, {})}


def test_megatron_parallel_layouts_match_one_rank(tmp_path):
    from test_trainer_parallel import TOL, compare, run_layouts

    from services.rollout.families import build_family
    from services.rollout.tiny_moe import TinyMoeConfig

    model_dir = build_family(tmp_path / "model", FAMILY, TinyMoeConfig(num_layers=4,
                                                                      first_k_dense=1))
    ref = run_layouts(tmp_path / "ref", model_dir, {"ref": (1, {}, {})})["ref"][0]
    for name, ranks in run_layouts(tmp_path / "layouts", model_dir, PARALLEL).items():
        assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
        res = compare(ref, ranks, TOL)
        print(name, res)
        assert res["ok"] and all(r["export_exact"] for r in ranks), (name, res)
