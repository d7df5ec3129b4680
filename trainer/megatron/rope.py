"""RoPE of an HF config as megatron-core 0.19's GPTModel builds it (trainer.megatron.model).

Read from `rope_parameters` (transformers 5) or `rope_scaling` (4.x): what megatron-core can build
(linear, llama3 with its fixed constants, yarn) is kept in `RopeScaling`; anything else is refused
by name, never silently dropped (the engine applies it). Partial rotary (`partial_rotary_factor`)
is megatron's `rotary_percent`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of an HF config, as megatron-core 0.19 builds it (`trainer.megatron.model`)."""

    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_positions: int = 0  # llama3 / yarn: the pretraining context
    beta_fast: float = 32.0  # yarn ramp bounds
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: set (with mscale_all_dim) only when HF uses both
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dims


SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
# megatron-core 0.19 RotaryEmbedding._apply_scaling: GPTModel passes only the factor.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


def rope_params(cfg: dict) -> dict:
    """The one RoPE dict of an HF config. transformers 5 writes `rope_parameters` (type
    "default" when unscaled); a 4.x `rope_scaling` next to it still scales."""
    new, old = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    params = dict(old if _rope_type(new) == "default" and old else new)
    params.setdefault("rope_theta", new.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return params


def _rope_type(p: dict) -> str:
    return str(p.get("rope_type") or p.get("type") or "default")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn(p: dict, max_positions: int) -> RopeScaling:
    orig = int(p.get("original_max_position_embeddings") or max_positions)
    factor = float(p.get("factor") or max_positions / orig)
    # transformers uses mscale / mscale_all_dim only when both are non-zero
    mscale, mscale_all = float(p.get("mscale") or 0), float(p.get("mscale_all_dim") or 0)
    both = bool(mscale and mscale_all)
    want = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) \
        if both else _yarn_mscale(factor)
    given = p.get("attention_factor")
    if given is not None and not math.isclose(float(given), want, rel_tol=1e-6):
        raise ValueError(f"rope_scaling.attention_factor: {given} differs from the value "
                         f"megatron-core derives from factor/mscale ({want:.6g}); not supported")
    return RopeScaling("yarn", factor, orig, float(p.get("beta_fast") or 32),
                       float(p.get("beta_slow") or 1), mscale if both else None,
                       mscale_all if both else None, bool(p.get("truncate", True)))


def rotary_percent(cfg: dict, default: float = 1.0) -> float:
    """The fraction of each head's dims that RoPE rotates (HF partial_rotary_factor; transformers
    5 keeps it in rope_parameters, 4.x at the top level; `default` when absent). Both HF and
    megatron rotate the first int(head_dim * fraction) dims, rotate-half style, with inv_freq
    over that width."""
    p = rope_params(cfg)
    value = float(p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))
    if not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor: {value} is not in (0, 1]")
    return value


def rope_from_hf_config(cfg: dict, partial: float | None = None) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) of an HF config; ValueError names what megatron cannot build.
    `partial`: the family's partial_rotary_factor default (None: its HF model ignores the field,
    which must then be 1)."""
    p = rope_params(cfg)
    kind, theta = _rope_type(p), float(p["rope_theta"])
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"rope_scaling.type: {kind!r} is not supported by the megatron trainer "
                         f"(megatron-core 0.19 builds {', '.join(SUPPORTED_ROPE)}); dynamic NTK "
                         "and longrope rescale by sequence length, which it does not model")
    if partial is None and rotary_percent(cfg) != 1.0:
        raise ValueError("rope_scaling.partial_rotary_factor: partial rotary is not supported "
                         f"for model_type {cfg.get('model_type')!r} (its HF model ignores it)")
    if rotary_percent(cfg, partial or 1.0) != 1.0 and kind not in ("default", "linear"):
        raise ValueError(f"rope_scaling.partial_rotary_factor: partial rotary with {kind} "
                         "scaling is not mapped (default and linear rope only)")
    if kind == "default":
        return theta, RopeScaling()
    if kind == "yarn":
        return theta, _yarn(p, int(cfg.get("max_position_embeddings", 4096)))
    factor = float(p.get("factor", 0))
    if not factor >= 1:
        raise ValueError(f"rope_scaling.factor: {kind} scaling needs a factor >= 1, got {factor}")
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    llama3 = _LLAMA3_FIXED | {"original_max_position_embeddings": cfg.get(
        "max_position_embeddings", 8192)} | p
    for key, fixed in _LLAMA3_FIXED.items():
        if float(llama3[key]) != fixed:
            raise ValueError(f"rope_scaling.{key}: {llama3[key]} - megatron-core 0.19 applies "
                             f"llama3 scaling with {key}={fixed} only")
    return theta, RopeScaling("llama3", factor, 8192)
