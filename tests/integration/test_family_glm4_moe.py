"""GLM-4.5/4.6/4.7 MoE end to end on the HF backend: vLLM-CPU capture (tests/integration/family_chain).

GLM-4.x MoE brings DeepSeek-V3's grouped sigmoid router (selection-only e_score_correction_bias,
group-limited top-k, routed_scaling_factor), GQA with partial rotary and QKV bias, a shared expert
and a leading dense layer. The megatron backend refuses it at boot (router bias buffer and partial
rotary not mapped by r3flow yet). The exported weights vLLM runs are the HF trainer's.
"""

from __future__ import annotations

import json

import pytest
from family_chain import (
    build_chain,
    check_capture_equals_hf,
    check_greedy_equals_hf,
    check_trainer_r3_equals_hf_forced,
    trainer_config,
)

pytestmark = pytest.mark.timeout(900)
FAMILY = "glm4_moe"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp(FAMILY), FAMILY, export_backend="hf")


def test_vllm_capture_equals_hf_router_choice_teacher_forced(chain):
    assert check_capture_equals_hf(chain) == 1.0


def test_hf_export_loads_into_vllm_and_greedy_equals_hf(chain):
    check_greedy_equals_hf(chain)


def test_hf_trainer_r3_logprobs_equal_hf_forced_fp32(chain):
    m = check_trainer_r3_equals_hf_forced(chain, "hf")
    print(json.dumps({"family": FAMILY, "backend": "hf", "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


def test_megatron_backend_refuses_glm4_moe(chain):
    from trainer.backend import make_trainer

    with pytest.raises(ValueError, match="model_type: 'glm4_moe' is not supported by the megatron "
                       "trainer: .*e_score_correction_bias router buffer"):
        make_trainer(trainer_config(chain.model_dir, "megatron"))
