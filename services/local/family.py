"""`r3flow local --family NAME`: which tiny model the run builds, and what the family decides.

The family (services.common.families) picks the trainer backend when the user named
none: megatron where trainer.megatron.families maps the family (the refusal is tried on the
run's own model config, so a config-dependent refusal counts too), else hf. A user who names
megatron for a family it refuses gets that refusal at boot. What a family needs from the HF
backend or from vLLM-CPU (its `hf_knobs`, `engine_dtype`: GPT-OSS trains with eager attention and
unpacked micro-batches, and vLLM-CPU runs it in bf16 only) is read from its family module and
set here, never left to the user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common import families
from services.common.config import ConfigError
from services.common.tiny_moe import TinyMoeConfig

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class FamilyPlan:
    """What `r3flow local` runs for one family."""

    family: str
    backend: str  # trainer backend: megatron | hf
    why: str  # why that backend (logged)
    hf: dict[str, Any] = field(default_factory=dict)  # hf backend knobs of the family
    engine_dtype: str | None = None  # vLLM dtype the family needs (None: the run's dtype)


def megatron_refusal(family: str, model: TinyMoeConfig) -> str | None:
    """Why the megatron backend cannot train the tiny `family` model, or None if it can."""
    from trainer.megatron.hf_mapping import arch_from_hf_config

    cfg = families.hf_config(family, model).to_dict()
    try:
        arch_from_hf_config(cfg)
    except ValueError as e:
        return str(e)
    return None


def plan(family: str, backend: str | None, model: TinyMoeConfig) -> FamilyPlan:
    """The run's family plan; ConfigError (naming `trainer.backend`) when the user asked for a
    backend that refuses the family."""
    refusal = megatron_refusal(family, model)
    if backend == "megatron" and refusal:
        raise ConfigError(f"trainer.backend: megatron refuses family {family!r}: {refusal}")
    if backend is not None:
        why = "set by the user"
    elif refusal:
        backend, why = "hf", f"the megatron backend refuses it ({refusal})"
    else:
        backend, why = "megatron", "the megatron backend maps it"
    fam = families.get(family)
    return FamilyPlan(family, backend, why, fam.hf_knobs if backend == "hf" else {},
                      fam.engine_dtype)


def log_plan(p: FamilyPlan, run_dtype: str) -> None:
    """One line per decision the family made (the run's dtype: fp32 | bf16)."""
    log.info("family %s: trainer backend %s (%s)", p.family, p.backend, p.why)
    if p.hf:
        log.info("family %s: hf backend knobs %s (set by the family)", p.family, p.hf)
    if p.engine_dtype and p.engine_dtype != {"bf16": "bfloat16", "fp32": "float32"}[run_dtype]:
        log.info("family %s: vLLM-CPU engine dtype %s (the only one it runs), trainer dtype %s",
                 p.family, p.engine_dtype, run_dtype)


def build_model(out_dir: Path, family: str, model: TinyMoeConfig) -> Path:
    """The run's random-init tiny model of `family`."""
    return families.build_family(out_dir, family, model)
