"""GLM-4.5/4.6/4.7 MoE: what only this family has (the shared chain checks and layouts:
tests/integration/test_families.py).

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
from family_chain import forced_samples, trainer_config

pytestmark = pytest.mark.timeout(900)
FAMILY = "glm4_moe"


@pytest.fixture(scope="module")
def chain(family_chain):
    return family_chain(FAMILY)


def test_selection_bias_and_groups_change_the_routers_choice(chain):
    """On the chain's tokens HF's own choice differs, for some token-layers, from the plain top-k
    of the logits and from the group-limited top-k without the selection bias: the chain would
    catch a dropped bias or group limit."""
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    seen = []

    def hook(gate, _inputs, out):
        logits_TE, _, own_TK = out
        k = own_TK.shape[-1]
        unbiased_TK = topk_routing_with_score_function(
            logits_TE, k, num_groups=gate.num_group, group_topk=gate.topk_group,
            score_function="sigmoid", dense_output=True)[1]
        seen.append([(x.sort(-1).values != own_TK.sort(-1).values).any(-1).float().mean()
                     for x in (logits_TE.topk(k, -1).indices, unbiased_TK)])

    hooks = [layer.mlp.gate.register_forward_hook(hook)
             for layer in chain.hf.model.layers if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            for tokens, _ in chain.rollouts:
                chain.hf(torch.from_numpy(tokens[None]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    plain, bias = np.asarray(seen, dtype=np.float64).mean(0)
    print(json.dumps({"family": FAMILY, "choice_differs_from_plain_topk": plain,
                      "choice_differs_without_bias": bias}))
    assert plain > 0.05 and bias > 0.05


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

