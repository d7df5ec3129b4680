"""model.batch_first_logits (issue 44) against megatron's own logits on CPU (real megatron-core
0.19.2, gloo, 1 rank, fp32, same checkpoint): the output layer fed [B, S, H] makes the [B, S, V]
logits that GPTModel returns without its transpose copy (a GPTModel subclass whose output
layer is a ColumnParallelLinear subclass; no forward rebound on an instance). Every logit is the same dot product
(equal bit for bit); the output layer's weight gradient sums the tokens in another order (fp32
rounding). On CUDA in bf16: tests/gpu/test_batch_first_logits_gpu.py; its time on one H200
(issue 55, docs/benchmarks/megatron-parallel.md) made it `auto` (on with the fast path).
Legend: B batch, S sequence, H hidden, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=2,
                                                                        first_k_dense=1))


def _build(model_dir, **model):
    from trainer.megatron.model import ModelConfig, build_model, init_parallel

    cfg = ModelConfig(**model)
    init_parallel(cfg)
    return build_model(model_dir, cfg)


def _run(built, tokens_BS):
    """Logits [B, S, V], whether they are the output layer's own storage (no copy), and the
    gradients of their sum of squares."""
    made = []
    hook = built.module.output_layer.register_forward_hook(
        lambda _m, _i, out: made.append(out[0].untyped_storage().data_ptr()))
    built.module.zero_grad()
    pos = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
    logits = built.module(input_ids=tokens_BS, position_ids=pos, attention_mask=None)
    hook.remove()
    (logits.float() ** 2).mean().backward()
    grads = {k: p.grad.clone() for k, p in built.module.named_parameters() if p.grad is not None}
    return logits.detach(), made == [logits.untyped_storage().data_ptr()], grads


def test_batch_first_logits_equal_megatrons_without_the_copy(model_dir):
    torch.manual_seed(0)
    tokens = torch.randint(4, 100, (3, 20))  # B 3 != S: a swapped layout would show
    base, base_own, g_base = _run(_build(model_dir), tokens)
    built = _build(model_dir, batch_first_logits=True)
    assert type(built.module).__name__ == "BatchFirstGPTModel"
    first, first_own, g_first = _run(built, tokens)
    assert tuple(first.shape) == (3, 20, base.shape[-1]) and first.is_contiguous()
    assert not base_own and first_own  # megatron copies its [S, B, V] logits; this does not
    assert torch.equal(first, base)
    assert set(g_first) == set(g_base)
    for k in g_base:
        assert torch.allclose(g_first[k], g_base[k], rtol=1e-5, atol=1e-7), k


def test_auto_is_the_fast_paths_and_sequence_parallel_is_refused():
    """auto by default (issue 55 measured it on one H200: r3 0.152 -> 0.143 s): the fast path."""
    from trainer.megatron.config import ModelConfig

    assert ModelConfig(dtype="bf16").fast_path(cuda=True).batch_first_logits is True
    assert ModelConfig(dtype="bf16", batch_first_logits=False).fast_path(
        cuda=True).batch_first_logits is False
    auto = {"batch_first_logits": "auto"}
    assert ModelConfig(dtype="bf16", **auto).fast_path(cuda=True).batch_first_logits is True
    assert ModelConfig(dtype="bf16", **auto).fast_path(cuda=False).batch_first_logits is False
    assert ModelConfig(**auto).fast_path(cuda=True).batch_first_logits is False  # fp32
    sp = ModelConfig(dtype="bf16", tensor_parallel=2, sequence_parallel=True, **auto)
    assert sp.fast_path(cuda=True).batch_first_logits is False
    with pytest.raises(ValueError, match="model.batch_first_logits: needs sequence_parallel"):
        ModelConfig(tensor_parallel=2, sequence_parallel=True, batch_first_logits=True)


def test_a_trainer_step_with_it_matches_megatrons(model_dir):
    """A whole r2 GRPO step (micro-batch 2) with and without: the same loss and grad norm to
    fp32 rounding."""
    from trainer_fixtures import toy_samples

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.megatron.batch_first_logits import BatchFirstOutputLayer

    out = {}
    for switch in (False, True):
        tr = make_trainer(TrainerConfig(model_dir=str(model_dir),
                                        model={"batch_first_logits": switch},
                                        data={"micro_batch_size": 2}, optim={"lr": 1e-4}))
        layer = tr.backend.policy.module.output_layer
        assert isinstance(layer, BatchFirstOutputLayer) is switch
        assert "forward" not in vars(layer)  # a subclass, nothing rebound on the instance
        assert layer.weight.is_embedding_or_output_parameter  # megatron's tag, as on its own
        out[switch] = tr.train_step(toy_samples(7), "r2")
    for key in ("loss", "grad_norm"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-5), key
