"""Toy GRPO samples shared by the trainer tests and their rank worker scripts (their launcher
is tests.support.ranks).

Importable both from pytest (this folder is on sys.path) and from the worker scripts that
run as `python tests/integration/<test>.py` (the script's folder is sys.path[0]).
"""

from __future__ import annotations

import numpy as np


def toy_samples(seed: int) -> list:
    """Four samples (6 prompt + 4-8 response tokens, two groups) from `seed`."""
    from trainer.samples.batch import Sample

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


# A tiny MoE narrow enough that many layers stay cheap (services.common.tiny_moe sizes).
TINY = dict(hidden_size=32, moe_intermediate_size=32, intermediate_size=64,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def natural_samples(model_dir, rewards, seed=0, prompt_len=5, prefix="g", lengths=None):
    """Samples whose routing and logprobs are the HF model's own (an fp32 engine), two per
    group (`prefix`<i // 2>), trajectory ids t<i>; `lengths`: response lengths (else 4-7).
    Routing is over the MoE layers only (transformers returns router logits of those)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.samples.batch import Sample

    k = 2
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    moe = hf.config.num_hidden_layers - len(getattr(hf.config, "mlp_only_layers", None) or ())
    rng = np.random.default_rng(seed)
    out = []
    for i, reward in enumerate(rewards):
        r = int(rng.integers(4, 8)) if lengths is None else lengths[i]
        toks = torch.from_numpy(rng.integers(4, 90, prompt_len + r)).unsqueeze(0)
        with torch.no_grad():
            o = hf(toks, output_router_logits=True, use_cache=False)
        ids_TLK = torch.stack([x.topk(k, -1).indices for x in o.router_logits], 1).numpy()
        assert ids_TLK.shape[1] == moe, (ids_TLK.shape, moe)
        lp = torch.log_softmax(o.logits[0].float(), -1)[:-1].gather(-1, toks[0, 1:, None])[:, 0]
        out.append(Sample(toks[0].numpy(), prompt_len, lp[prompt_len - 1:].numpy(),
                          np.ones(r, bool), float(reward), f"{prefix}{i // 2}",
                          routing_TLK=ids_TLK[:-1], trajectory_id=f"t{i}"))
    return out


def randomise_layer(sample, layer: int, seed: int = 0) -> None:
    """Random distinct ids on one MoE layer of every row of `sample` (chance: K/E)."""
    E, K = 8, 2
    rng = np.random.default_rng(seed)
    ids = sample.routing_TLK.copy()
    ids[:, layer] = np.stack([rng.permutation(E)[:K] for _ in range(ids.shape[0])])
    sample.routing_TLK = ids


