"""The megatron fast path (model.experts: grouped, model.attention: sdpa) against the plain path
on CPU (real megatron-core 0.19.2, gloo, 1 rank, fp32), same weights, same replayed routing.

Grouped experts on CPU run the reference loop over the stacked weights: logits and gradients are
bit-identical to SequentialMLP's. SDPA's CPU math kernel sums in another order than
DotProductAttention: logits within 1e-5 (fp32). On CUDA in bf16 the grouped GEMM and the flash
kernel round differently again (tests/gpu and the bench check those).
Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)
PATHS = {"plain": {}, "grouped": {"experts": "grouped"},
         "fast": {"experts": "grouped", "attention": "sdpa"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=3,
                                                                        first_k_dense=1))


def _build(model_dir, **fast):
    from trainer.megatron.model import ModelConfig, build_model, init_parallel

    cfg = ModelConfig(**fast)
    init_parallel(cfg)
    return build_model(model_dir, cfg)


def _run(built, tokens_BS):
    """Logits [B, S, V] and the gradient of their sum of squares, keyed like the plain path's."""
    from trainer.megatron.grouped_experts import unstack_experts

    built.module.zero_grad()
    pos = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
    logits = built.module(input_ids=tokens_BS, position_ids=pos, attention_mask=None)
    (logits.float() ** 2).mean().backward()
    grads = {k: p.grad for k, p in built.module.named_parameters()}
    return logits.detach(), unstack_experts(grads)


@pytest.fixture(scope="module")
def models(model_dir):
    """The three paths' models, built once for the module (tests that change weights restore
    them)."""
    return {name: _build(model_dir, **fast) for name, fast in PATHS.items()}


@pytest.fixture(scope="module")
def runs(models):
    torch.manual_seed(0)
    tokens = torch.randint(4, 100, (2, 24))
    return {name: _run(built, tokens) for name, built in models.items()}


def test_grouped_experts_equal_sequential_bit_for_bit(runs):
    (plain, g_plain), (grouped, g_grouped) = runs["plain"], runs["grouped"]
    assert torch.equal(plain, grouped)
    assert set(g_plain) == set(g_grouped)
    assert all(torch.equal(g_plain[k], g_grouped[k]) for k in g_plain)


def test_sdpa_matches_unfused_attention_to_fp32_rounding(runs):
    (plain, g_plain), (fast, g_fast) = runs["plain"], runs["fast"]
    assert (fast - plain).abs().max() < 1e-5
    for k in g_plain:
        assert torch.allclose(g_fast[k], g_plain[k], rtol=1e-4, atol=1e-6), k


def test_fast_path_modules_sit_in_megatron_slots(models):
    from trainer.megatron.fused_attention import SdpaAttention
    from trainer.megatron.grouped_experts import GroupedExperts

    built = models["fast"]
    layers = built.module.decoder.layers
    assert all(isinstance(layer.self_attention.core_attention, SdpaAttention) for layer in layers)
    assert isinstance(layers[1].mlp.experts, GroupedExperts)
    w = layers[1].mlp.experts.linear_fc1.weight
    assert tuple(w.shape) == (8, 2 * built.config.moe_ffn_hidden_size, built.config.hidden_size)


def test_grouped_export_is_the_checkpoint_and_old_layout_loads(model_dir, models, runs):
    from safetensors.torch import load_file

    from trainer.megatron.hf_mapping import export_hf_state_dict
    from trainer.megatron.model import copy_into, load_hf_weights
    from trainer.megatron.parallel import model_weights

    plain, grouped = models["plain"], models["grouped"]
    ref = load_file(str(model_dir / "model.safetensors"))
    out = export_hf_state_dict(grouped.module, grouped.arch)
    assert set(out) == set(ref) and all(torch.equal(out[k], ref[k]) for k in ref)
    old = {k: v.detach() + 1 for k, v in model_weights(plain.module).items()}  # r3flow checkpoint
    copy_into(grouped.module, old)
    back = export_hf_state_dict(grouped.module, grouped.arch)
    assert all(torch.equal(back[k], ref[k] + 1) for k in ref)
    copy_into(plain.module, model_weights(grouped.module))  # and the other way
    assert torch.equal(plain.module.decoder.layers[1].mlp.experts.local_experts[3]
                       .linear_fc2.weight, old["decoder.layers.1.mlp.experts.local_experts.3"
                                              ".linear_fc2.weight"])
    for built in (plain, grouped):  # back to the checkpoint for the module's other tests
        load_hf_weights(built, model_dir)


def test_grouped_experts_refuse_expert_biases_and_expert_tp():
    from types import SimpleNamespace

    from trainer.megatron.grouped_experts import GroupedExperts

    base = {"add_bias_linear": False, "expert_tensor_parallel_size": 1,
            "moe_apply_probs_on_input": False, "bias_activation_fusion": False}
    for bad in ({"add_bias_linear": True}, {"expert_tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="model.experts"):
            GroupedExperts(2, SimpleNamespace(**(base | bad)))


def test_fast_trainer_step_matches_the_plain_one(model_dir):
    """A whole r2 GRPO step with grouped experts, overlapped grad reduce and fused AdamW against
    the plain trainer: same loss and grad norm to fp32 rounding, and the same weights after the
    step to 1e-6 (Adam's fused kernel rounds otherwise than its foreach loop). sdpa is left out
    here: Adam's first step is lr * sign(g) wherever |g| is near eps, so its 1e-7 gradient
    rounding moves such weights by lr (its gradients are checked above)."""
    from trainer_fixtures import toy_samples

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    out = {}
    for name, model, optim in (("plain", {}, {}), ("fast", PATHS["grouped"], {
            "overlap_grad_reduce": True, "fused_adam": True})):
        tr = make_trainer(TrainerConfig(model_dir=str(model_dir), model=model,
                                        data={"micro_batch_size": 2},
                                        optim={"lr": 1e-4} | optim))
        out[name] = (tr.train_step(toy_samples(7), "r2"), tr.export_hf_state_dict())
    (plain, w_plain), (fast, w_fast) = out["plain"], out["fast"]
    for key in ("loss", "grad_norm"):
        assert fast[key] == pytest.approx(plain[key], rel=1e-5), key
    assert all(torch.allclose(w_fast[k], w_plain[k], rtol=0, atol=1e-6) for k in w_plain)
