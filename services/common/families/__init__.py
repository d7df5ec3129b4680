"""The model-family registry: one module per MoE family, read by every part of r3flow.

Each module of this package not starting with `_` is a family: it defines `FAMILY`, a
`services.common.families._base.Family` that holds the family's neutral facts (HF model_type, tiny
model builder, HF router classes and their replay rule, HF backend knobs, vLLM dtype and caveats,
its reading of config.json's sizes (`model_shape`), planner models) and names its megatron code
by a dotted path ("module:function") that the megatron backend resolves (`hook`): this package
imports neither the trainer nor the rollout service, so the import graph
(tests/unit/test_import_graph.py) has no arrow from here to a backend.
The registry finds the modules itself: adding a family is one new file here (plus, for the
megatron backend, its trainer/megatron/family_<name>.py) and its tests (docs/families.md).

Readers: the megatron backend (trainer.megatron.families, model, config, hf_mapping), the HF
backend (trainer.hf.routers, model), the rollout service (services.rollout.engine, mla_rope,
model_cli), `r3flow local` (services.local.family, config) and the planner (trainer.plan.models).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.families._base import Family
from services.common.families._shape import ConfigKeys, ModelShape
from services.common.tiny_moe import TinyMoeConfig, build_tokenizer

REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry; ValueError when its name or its rank is taken."""
    if family.name in REGISTRY:
        raise ValueError(f"family: {family.name!r} is registered twice")
    holder = next((f.name for f in REGISTRY.values() if f.rank == family.rank), None)
    if holder is not None:  # rank orders listings and DEFAULT: a tie would order by name
        raise ValueError(f"family {family.name!r}: rank {family.rank} is taken by {holder!r}")
    REGISTRY[family.name] = family
    return family


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            register(importlib.import_module(f"{__name__}.{info.name}").FAMILY)


def all_families() -> list[Family]:
    """Every registered family, in listing order (the default first)."""
    return sorted(REGISTRY.values(), key=lambda f: (f.rank, f.name))


def names() -> tuple[str, ...]:
    return tuple(f.name for f in all_families())


def find(name: Any) -> Family | None:
    """The family of HF model_type `name`, or None when it is not registered."""
    return REGISTRY.get(name) if isinstance(name, str) else None


def get(name: str) -> Family:
    """The family `name`; ValueError naming the registered ones."""
    family = find(name)
    if family is None:
        raise ValueError(f"family: {name!r} is not one of {', '.join(names())}")
    return family


def model_shape(cfg: Mapping[str, Any]) -> ModelShape:
    """The sizes of the model of HF config.json `cfg`, as the family its `model_type` names
    reads them (`Family.shape`); ValueError, one line, for a model_type no family registers or a
    key its family needs."""
    family = find(cfg.get("model_type"))
    if family is None or family.shape is None:
        known = ", ".join(f.name for f in all_families() if f.shape is not None)
        raise ValueError(f"model_type: {cfg.get('model_type')!r} is not a registered family "
                         f"({known})")
    return family.shape(ConfigKeys(cfg))


def hook(path: str) -> Any:
    """The object a family names by "module:attribute" (backend code this package must not
    import); ValueError naming the path when it does not resolve."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"family hook {path!r} does not resolve: {e}") from None


def hf_config(family: str, cfg: TinyMoeConfig):
    """The transformers config of a tiny `family` model; ValueError for an unknown family."""
    return get(family).tiny_config(cfg)


def _randomise(model, std: float) -> None:
    """Random weights everywhere but norms; biases that steer routing get a visible spread."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only bias (DeepSeek-V3/GLM)
                buf.normal_(0.0, 0.05)


def build_family(out_dir: str | Path, family: str = "", cfg: TinyMoeConfig | None = None) -> Path:
    """Write a seeded random-init tiny `family` model (safetensors, config, tokenizer) with
    transformers' own config and model classes (nothing downloaded); default: DEFAULT."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = cfg or TinyMoeConfig()
    fam = get(family or DEFAULT)
    if fam.build is not None:
        return Path(fam.build(out_dir, cfg))
    config = fam.tiny_config(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, cfg.init_std)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


_discover()
DEFAULT = all_families()[0].name  # the family a run builds when none is named

__all__ = ["DEFAULT", "REGISTRY", "Family", "ModelShape", "all_families", "build_family",
           "find", "get", "hf_config", "hook", "model_shape", "names", "register"]
