"""DeepSeek-V3 on megatron-core 0.19: its multi-latent attention (MLA: config, spec, weights) and
its FamilyArch (`deepseek_v3_arch`: DeepSeek-V3's router from trainer.megatron.grouped_router,
ungated shared experts).

HF `deepseek_v3` (Moonlight, Kimi-K2, DeepSeek-V3) attention maps onto megatron-core's
`MLASelfAttention` (MLATransformerConfig, the local layer spec with multi_latent_attention):
  * q: HF `q_proj` (q_lora_rank None) -> `linear_q_proj`; or HF `q_a_proj`, `q_a_layernorm`,
    `q_b_proj` -> `linear_q_down_proj`, `q_layernorm`, `linear_q_up_proj`. Each head's output
    rows are [nope (qk_nope_head_dim), rope (qk_rope_head_dim)] in both;
  * kv: HF `kv_a_proj_with_mqa` [kv_lora_rank + rope, H] -> `linear_kv_down_proj` (same rows:
    latent first, the shared rope key last), `kv_a_layernorm` -> `kv_layernorm`, `kv_b_proj`
    [nh*(nope + v), kv_lora_rank] -> `linear_kv_up_proj` (same per-head [k_nope, v] rows);
  * `o_proj` -> `linear_proj` (as for every family, trainer.megatron.hf_mapping).
RoPE: megatron's MLA always de-interleaves the rope dims before its half rotation
(`mla_rotary_interleaved=True` in MLASelfAttention), which is HF's `rope_interleave: true`
exactly (HF rotates pairs (x0, x1), (x2, x3), ... and writes [evens, odds]); the rows map
unchanged. For `rope_interleave: false` (HF rotates halves) the rope rows of q and of the kv
latent are interleaved on the way in (`_to_interleaved`), so megatron's de-interleave gives back
HF's halves, and de-interleaved on the way out.
Softmax scale and YaRN: megatron's 1/sqrt(nope + rope) times mscale(factor, mscale_all_dim)^2 is
HF's `yarn_apply_mscale`; its rope concentration mscale(factor, mscale)/mscale(factor,
mscale_all_dim) is HF's yarn attention_factor when both are set (else both use mscale(factor)).
Local spec gaps, filled through the spec's submodule fields (`mla_spec`):
  * the local core attention (DotProductAttention) takes no k_channels/v_channels (MLA passes
    them): `MlaDotProductAttention` accepts them and checks them against the config;
  * with q_lora_rank None megatron's qk_layernorm wants a TransformerEngine fused norm+linear for
    `linear_q_proj`; instead qk_layernorm stays off and `linear_kv_up_proj` is
    `NormedColumnParallelLinear` (the kv RMSNorm, then the linear), TE's own layout for it.
Tensor parallelism is refused (`check_mla_layout`): with TP2 + SP the tiny model's logprobs equal
one rank's but the grad norm is off by 0.085. Cause (per-parameter grads of an all-dense tiny
DeepSeek-V3, TP2 + SP against one rank: in the last layer only the 64 rope rows of
`linear_kv_down_proj` differ; earlier layers inherit a wrong input gradient): the local spec's
`linear_kv_down_proj` must be a ColumnParallelLinear (MLASelfAttention accepts no local
duplicated linear), its output is gathered over TP, and the shared rope key cut from it feeds
each rank's heads with no TP reduction in backward, so the rope columns (held by the last TP
rank) get only that rank's heads' gradient. (megatron's TE spec builds the down projections as
duplicated TELinear, another path, not checked here.) Pipeline and expert parallelism match one
rank (tests/integration/test_families.py).
MTP: HF's DeepseekV3ForCausalLM builds `num_hidden_layers` layers and never loads the
multi-token-prediction layers (`model.layers.{num_hidden_layers}...`, DeepSeek-V3's
`_keys_to_ignore_on_load_unexpected`); vLLM's main model skips them too. The trainer does the
same once the user opts in with `drop_mtp: true` (trainer.backend.check_mtp refuses such a
checkpoint otherwise): they are not trained, not exported, and a warning names
`num_nextn_predict_layers`.
Legend: H hidden, nh heads, r rope dims (qk_rope_head_dim).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from trainer.megatron.family_arch import FamilyArch, MlaArch, WeightMapping
from trainer.megatron.grouped_router import deepseek_moe_fields
from trainer.megatron.rope import rope_params

log = logging.getLogger(__name__)


def deepseek_v3_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of a deepseek_v3 HF config dict: DeepSeek-V3's router
    (trainer.megatron.grouped_router), an ungated shared expert of width
    `n_shared_experts * moe_intermediate_size` (HF `mlp.shared_experts`), no QK-norm (MLA's
    latent norms are mapped here: `attention_to_megatron`); `first_k_dense_replace` is read by
    hf_mapping."""
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise ValueError(f"quantization_config: {quant!r} weights (DeepSeek-V3's and Kimi-K2's "
                         "published FP8 block-scaled checkpoints) are not mapped: the trainer "
                         "loads bf16/fp32 weights; convert the checkpoint to bf16 first")
    mla = mla_from_hf_config(cfg)
    check_mla_rope(rope_params(cfg))
    return FamilyArch(qk_norm=False, mla=mla, mapping=_MAPPING,
                      **deepseek_moe_fields(cfg, "DeepseekV3MoE"))


def mla_from_hf_config(cfg: dict) -> MlaArch:
    """MlaArch of an HF deepseek_v3 config dict; ValueError names what is not mapped."""
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp:
        log.warning("num_nextn_predict_layers: %d multi-token-prediction layer(s) in the "
                    "checkpoint are not trained or exported (HF's DeepseekV3ForCausalLM and "
                    "vLLM's main model do not load them either)", mtp)
    q_lora = cfg.get("q_lora_rank")
    return MlaArch(q_lora_rank=int(q_lora) if q_lora else None,
                   kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_dim=int(cfg["qk_nope_head_dim"]),
                   qk_rope_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
                   rope_interleave=bool(cfg.get("rope_interleave", True)))


def check_mla_layout(tensor_parallel: int) -> None:
    """Refuse the parallel layouts megatron-core 0.19's local MLA cannot train (module doc)."""
    if tensor_parallel > 1:
        raise ValueError(
            f"model.tensor_parallel {tensor_parallel}: MLA on megatron-core 0.19's local spec "
            "trains wrong gradients under tensor parallelism: the shared rope key's gradient is "
            "not reduced over the TP ranks (its linear_kv_down_proj must be a ColumnParallelLinear;"
            " trainer/megatron/family_deepseek_v3.py); use expert, pipeline or data parallelism")


def check_mla_rope(params: dict) -> None:
    """Refuse a YaRN setting megatron's MLA cannot reproduce (HF rope parameters dict)."""
    mscale, mscale_all = float(params.get("mscale") or 0), float(params.get("mscale_all_dim") or 0)
    if mscale_all and not mscale:
        raise ValueError("rope_scaling.mscale: HF scales the rope by mscale(factor) and the "
                         "softmax by mscale_all_dim; megatron-core 0.19's MLA ties both to "
                         "mscale/mscale_all_dim: set mscale too")
    if params.get("truncate") is False:
        raise ValueError("rope_scaling.truncate: false is not built by megatron-core 0.19's MLA "
                         "(its YaRN always rounds the correction range)")


def mla_config_kwargs(m: MlaArch, rope: Any, theta: float) -> dict[str, Any]:
    """MLATransformerConfig fields of the HF attention (`rope` a trainer.megatron.rope.RopeScaling)."""
    kw: dict[str, Any] = {
        "multi_latent_attention": True, "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank, "qk_head_dim": m.qk_nope_dim,
        "qk_pos_emb_head_dim": m.qk_rope_dim, "v_head_dim": m.v_head_dim,
        # the local core attention reshapes its output with kv_channels: the value head width
        "kv_channels": m.v_head_dim,
        # megatron's MLA has no q norm without q_lora (mla_spec puts the kv norm in kv_up)
        "qk_layernorm": m.q_lora_rank is not None, "rotary_base": theta,
        "apply_rope_fusion": False, "rope_type": "rope", "rotary_scaling_factor": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.0}
    if rope.type == "yarn":
        both = rope.mscale is not None and rope.mscale_all_dim is not None
        kw |= {"rope_type": "yarn", "rotary_scaling_factor": rope.factor,
               "original_max_position_embeddings": rope.original_max_positions,
               "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
               "mscale": rope.mscale if both else 1.0,
               "mscale_all_dim": rope.mscale_all_dim if both else 0.0}
    elif rope.type != "default":
        raise ValueError(f"rope_scaling.type: {rope.type!r} is not built by megatron-core 0.19's "
                         "MLA (rope or yarn only)")
    return kw


# ---------------------------------------------------------------------- spec
@functools.cache
def _local_modules() -> tuple[type, type]:
    """(MlaDotProductAttention, NormedColumnParallelLinear): megatron imports stay lazy."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MlaDotProductAttention(DotProductAttention):
        """megatron's local DotProductAttention taking MLA's k/v channel arguments."""

        def __init__(self, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None and v_channels != self.config.kv_channels:
                raise ValueError(f"kv_channels: {self.config.kv_channels}, MLA's value heads "
                                 f"are {v_channels} wide")

    class NormedColumnParallelLinear(ColumnParallelLinear):
        """RMSNorm over the input, then ColumnParallelLinear (TE's LayerNormColumnParallelLinear
        layout: the norm weight is `layer_norm_weight`)."""

        def __init__(self, input_size: int, output_size: int, *, config: Any,
                     **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(
                torch.ones(input_size, dtype=config.params_dtype))
            # under sequence parallel each TP rank normalises its own tokens
            self.layer_norm_weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
            normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight,
                                                  self.eps)
            return super().forward(normed, *args, **kwargs)

    return MlaDotProductAttention, NormedColumnParallelLinear


def mla_spec(spec: Any, tcfg: Any) -> Any:
    """The local decoder block spec with MLA's local gaps filled (module docstring)."""
    from megatron.core.transformer.identity_op import IdentityOp

    core, normed = _local_modules()
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention.submodules
        attn.core_attention = core
        if tcfg.q_lora_rank is None:
            attn.q_layernorm, attn.kv_layernorm, attn.linear_kv_up_proj = \
                IdentityOp, IdentityOp, normed
    return spec


# ---------------------------------------------------------------------- weights
def _to_interleaved(w: torch.Tensor, r: int) -> torch.Tensor:
    """Rows [first half, second half] of each trailing r-row rope block -> interleaved pairs."""
    head = w.shape[0] // r
    return w.view(head, 2, r // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _to_halves(w: torch.Tensor, r: int) -> torch.Tensor:
    head = w.shape[0] // r
    return w.view(head, r // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _permute_rope(w: torch.Tensor, m: MlaArch, per: int, to_megatron: bool) -> torch.Tensor:
    """Permute the rope rows (the last r of every `per`-row block) for rope_interleave false."""
    if m.rope_interleave:
        return w
    blocks = w.view(-1, per, *w.shape[1:])
    nope, rope = blocks.split([per - m.qk_rope_dim, m.qk_rope_dim], dim=1)
    flat = rope.reshape(-1, *w.shape[1:])
    flat = _to_interleaved(flat, m.qk_rope_dim) if to_megatron else _to_halves(flat, m.qk_rope_dim)
    return torch.cat([nope, flat.view(rope.shape)], dim=1).reshape(w.shape)


def _names(m: MlaArch) -> dict[str, str]:
    """HF self_attn.* weight -> megatron self_attention.* weight."""
    kv_norm = "kv_layernorm.weight" if m.q_lora_rank is not None else \
        "linear_kv_up_proj.layer_norm_weight"
    # o_proj -> linear_proj is every family's (hf_mapping)
    out = {"kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
           "kv_a_layernorm.weight": kv_norm, "kv_b_proj.weight": "linear_kv_up_proj.weight"}
    if m.q_lora_rank is None:
        return out | {"q_proj.weight": "linear_q_proj.weight"}
    return out | {"q_a_proj.weight": "linear_q_down_proj.weight",
                  "q_a_layernorm.weight": "q_layernorm.weight",
                  "q_b_proj.weight": "linear_q_up_proj.weight"}


_ROPE_ROWS = {"linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight"}


def _rope_block(m: MlaArch, mc_name: str) -> int:
    """Rows per block whose last r rows are rope dims: a q head, or the whole kv latent."""
    if mc_name == "linear_kv_down_proj.weight":
        return m.kv_lora_rank + m.qk_rope_dim
    return m.qk_nope_dim + m.qk_rope_dim


def _map(sd: dict, m: MlaArch, src: str, dst: str, to_megatron: bool) -> dict[str, torch.Tensor]:
    out = {}
    for h, name in _names(m).items():
        frm, to = (h, name) if to_megatron else (name, h)
        w = sd[f"{src}.{frm}"]
        if name in _ROPE_ROWS:
            w = _permute_rope(w, m, _rope_block(m, name), to_megatron)
        out[f"{dst}.{to}"] = w
    return out


def attention_to_megatron(sd: dict, fam: FamilyArch, hf: str, mc: str
                          ) -> dict[str, torch.Tensor]:
    """One layer's HF `{hf}.self_attn.*` -> megatron `{mc}.self_attention.*`."""
    assert fam.mla is not None
    return _map(sd, fam.mla, f"{hf}.self_attn", f"{mc}.self_attention", to_megatron=True)


def attention_to_hf(sd: dict, fam: FamilyArch, mc: str, hf: str) -> dict[str, torch.Tensor]:
    """Inverse of `attention_to_megatron`."""
    assert fam.mla is not None
    return _map(sd, fam.mla, f"{mc}.self_attention", f"{hf}.self_attn", to_megatron=False)


_MAPPING = WeightMapping(attention_to_megatron=attention_to_megatron,
                         attention_to_hf=attention_to_hf)
