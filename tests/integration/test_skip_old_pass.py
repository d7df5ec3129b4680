"""loss.skip_old_policy_pass (issue 55) on CPU (real megatron-core, gloo, 1 rank, fp32): when a
batch takes one update, the step without the old-policy pass is the step with it. Same
checkpoint, same samples, a fresh trainer (fresh Adam state) for each setting: the loss, the
grad norm, the logprob diffs, the TIS weights, the agreement and every updated weight agree to
fp32 rounding, in r3 (rollout routing replayed; agreement checked on the update pass; with the
reference model) and in r2 (the update routes with the policy's own routing, which is what the
recording pass would have replayed). The config refusals are checked without a model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from trainer_fixtures import TINY, natural_samples

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"),
                          TinyMoeConfig(num_layers=3, first_k_dense=1, **TINY))


@pytest.fixture(scope="module")
def samples(model_dir):  # transformers loads before any process group exists
    return natural_samples(model_dir, [0.0, 1.0, 1.0, 0.0, 0.5, 0.25], seed=3)


def _cfg(model_dir, **kw):
    from trainer.config import TrainerConfig

    return TrainerConfig.model_validate(dict(
        model_dir=str(model_dir), data={"micro_batch_size": 2}, optim={"lr": 1e-3},
        replay={"agreement_floor": 0.5}) | kw)


def _step(model_dir, samples, skip: str, mode: str, loss: dict):
    from trainer.backend import make_trainer

    tr = make_trainer(_cfg(model_dir, loss={"skip_old_policy_pass": skip} | loss,
                           replay={"mode": mode, "agreement_floor": 0.5}))
    m = tr.train_step(copy.deepcopy(samples))
    return m, {k: v.detach().clone() for k, v in tr.backend.policy.module.named_parameters()}


CASES = {"r3": {"kl_coef": 0.05, "rollout_correction": {"is_level": "token"}},
         "r2": {"rollout_correction": {"is_level": "sequence"}}}


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_the_step_without_the_old_pass_is_the_step_with_it(model_dir, samples, mode):
    off, w_off = _step(model_dir, samples, "off", mode, CASES[mode])
    on, w_on = _step(model_dir, samples, "on", mode, CASES[mode])
    assert on["old_pass_skipped"] is True and off["old_pass_skipped"] is False
    assert on["old_pass_seconds"] < off["old_pass_seconds"]
    assert on["updates"] == off["updates"] == 1 and on["grad_norm"] > 0
    for k in ("loss", "grad_norm", "logprob_diff_mean", "logprob_diff_max", "mismatch_kl",
              "is_weight_mean", "entropy", "ppo_kl"):
        assert on[k] == pytest.approx(off[k], rel=1e-5, abs=1e-7), k
    if mode == "r3":
        assert on["kl_ref"] == pytest.approx(off["kl_ref"], rel=1e-5, abs=1e-7)
        assert on["routing_agreement"] == pytest.approx(off["routing_agreement"])
        assert on["routing_agreement_by_layer"] == pytest.approx(off["routing_agreement_by_layer"])
    else:
        assert "routing_agreement" not in on and "routing_agreement" not in off
    assert set(w_on) == set(w_off)
    moved = [k for k in w_off if not torch.equal(w_off[k], w_on[k])]
    for k in w_off:
        assert torch.allclose(w_on[k], w_off[k], rtol=1e-5, atol=1e-7), k
    assert len(moved) < len(w_off)  # most weights are equal bit for bit


def test_on_is_refused_where_it_cannot_apply_and_auto_falls_back(model_dir):
    from trainer.config import TrainerConfig

    refused = {"needs one update per batch": {"optim": {"ppo_epochs": 2}},
               "kl_in reward": {"loss": {"kl_in": "reward", "kl_coef": 0.1}},
               "MIS masks": {"loss": {"rollout_correction": {"mask_level": "token"}}},
               "pipeline_parallel > 1": {"model": {"pipeline_parallel": 2}},
               "backend hf": {"backend": "hf"},
               "r2 with MoE recompute": {"replay": {"mode": "r2"},
                                         "model": {"recompute_moe": True}}}
    hf_r2 = {"backend": "hf", "replay": {"mode": "r2"}, "hf": {"gradient_checkpointing": True}}
    for why, kw in refused.items():
        loss = kw.get("loss", {})
        with pytest.raises(ValueError, match=f"loss.skip_old_policy_pass: on does not apply: "
                                             f".*{why}"):
            TrainerConfig.model_validate(
                {"model_dir": str(model_dir)} | kw | {"loss": loss | {"skip_old_policy_pass": "on"}})
        auto = TrainerConfig.model_validate(
            {"model_dir": str(model_dir)} | kw | {"loss": loss | {"skip_old_policy_pass": "auto"}})
        assert why in (auto.old_pass_refusal(auto.replay.mode) or "")
    with pytest.raises(ValueError, match="on does not apply: r2 with MoE recompute"):
        TrainerConfig.model_validate({"model_dir": str(model_dir), "loss": {
            "skip_old_policy_pass": "on"}} | hf_r2)
    plain = TrainerConfig(model_dir=str(model_dir), loss={"skip_old_policy_pass": "on"})
    assert plain.old_pass_refusal("r3") is None and plain.old_pass_refusal("r2") is None
