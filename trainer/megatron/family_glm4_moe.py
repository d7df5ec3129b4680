"""GLM-4.5/4.6/4.7 MoE (`glm4_moe`) on megatron-core 0.19: what the family changes against Qwen3-MoE.

DeepSeek-V3's router (trainer.megatron.grouped_router), GQA attention with QKV bias
(`attention_bias`) and optional per-head QK-norm (`use_qk_norm`), partial rotary (HF
`partial_rotary_factor`, 0.5 when absent as in transformers and vLLM; megatron `rotary_percent`:
both rotate the first dims of each head, rotate-half style; read in hf_mapping), an ungated shared expert of width
`n_shared_experts * moe_intermediate_size` (HF `mlp.shared_experts`) and `first_k_dense_replace`
leading dense layers (hf_mapping). The MTP layer (`num_nextn_predict_layers`) is neither built nor
trained, as in transformers' Glm4MoeForCausalLM: the engine must not speculate with it.
"""

from __future__ import annotations

import logging

from trainer.megatron.family_arch import FamilyArch
from trainer.megatron.grouped_router import deepseek_moe_fields

log = logging.getLogger(__name__)


def glm4_moe_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of a glm4_moe HF config dict; ValueError names unmapped fields."""
    if int(cfg.get("num_nextn_predict_layers") or 0):
        log.warning("num_nextn_predict_layers: %s MTP layer(s) are not trained or exported by "
                    "the megatron trainer (transformers does not build them either)",
                    cfg["num_nextn_predict_layers"])
    # n_shared_experts 0 is refused there (vLLM 0.30 fails on it too)
    return FamilyArch(qkv_bias=bool(cfg.get("attention_bias", False)),
                      qk_norm=bool(cfg.get("use_qk_norm", False)), partial_rotary=0.5,
                      **deepseek_moe_fields(cfg, "Glm4MoeMoE"))
