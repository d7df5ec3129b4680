"""Toy GRPO samples shared by the trainer tests and their rank worker scripts.

Importable both from pytest (this folder is on sys.path) and from the worker scripts that
run as `python tests/integration/<test>.py` (the script's folder is sys.path[0]).
"""

from __future__ import annotations

import numpy as np


def toy_samples(seed: int) -> list:
    """Four samples (6 prompt + 4-8 response tokens, two groups) from `seed`."""
    from trainer.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(4):
        r = int(rng.integers(4, 9))
        out.append(Sample(rng.integers(4, 100, 6 + r), 6, np.full(r, -3.0, np.float32),
                          np.ones(r, bool), float(rng.random()), f"g{i % 2}"))
    return out


def load_hf_fp32(model_dir):
    """The HF model in fp32, eval mode. transformers 5 may leave the non-persistent RoPE buffers
    uninitialised when this process already holds a torch.distributed group (an earlier
    in-process trainer test), so they are recomputed here."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rope = hf.model.rotary_emb
    inv, _ = rope.compute_default_rope_parameters(hf.config)
    rope.inv_freq.copy_(inv)
    rope.original_inv_freq.copy_(inv)
    return hf
