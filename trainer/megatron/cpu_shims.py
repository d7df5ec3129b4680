"""The one place where megatron-core is adapted to run on a CPU-only torch (gloo backend).

Targets megatron-core 0.19.2. Every patch names the upstream symbol it stands in for; nothing
here runs when torch has CUDA (`apply_cpu_shims` returns False and changes nothing). The shims
are process-wide by nature (they replace module attributes), so they are applied once per
process, before any megatron model is built.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_CPU = torch.device("cpu")
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


class _NullStream:
    """Stands in for torch.cuda.Stream: every method is a no-op returning the stream itself."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, _name):
        return lambda *a, **k: self

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    __hash__ = object.__hash__


def _cpu_factory(fn):
    """Wrap a torch tensor factory so device='cuda...' lands on the CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    wrapper._r3flow_cpu_shim = True  # type: ignore[attr-defined]
    return wrapper


def _patch_torch_cuda() -> None:
    # megatron.core.* calls torch.cuda.current_device() for buffers and moves the router weight
    # there (megatron.core.transformer.moe.router.Router.gating); the alltoall token dispatcher
    # uses a side stream (torch.cuda.Stream / current_stream / stream) for D2H copies.
    # A class (not a lambda) so annotations like `torch.cuda.Stream | None` still evaluate.
    stream = _NullStream()
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment, return-value]
    torch.cuda.Stream = _NullStream  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    # pipeline_parallel.p2p_communication.P2PCommunicator._communicate_shapes (variable
    # sequence lengths under PP) synchronises the device after exchanging shapes.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # Optimizer, grad clipping, DDP buffers and schedules pass device="cuda" to tensor factories
    # and call Tensor.cuda() (megatron.core.optimizer.*, megatron.core.distributed.*).
    # torch's device context (`with torch.device(...)`, under which transformers builds a model
    # before loading it) tells factories by identity, from a set it builds on first use: build
    # it now, from torch's own functions. Built after the wrapping, it held the wrappers, the
    # context no longer saw `torch.tensor` as a factory, and every HF model loaded later in the
    # process kept an uninitialised RoPE `inv_freq` (garbage: its logits and routing wrong).
    with torch.device("meta"):
        torch.empty(0)
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "_r3flow_cpu_shim", False):
            setattr(torch, name, _cpu_factory(fn))
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]


def _patch_megatron() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    from megatron.core.tensor_parallel import random as mp_random

    # token_dispatcher.maybe_move_tensor_to_cpu: turns split sizes into numpy only for CUDA
    # tensors; all_to_all with EP>1 needs them as numpy on CPU too.
    token_dispatcher.maybe_move_tensor_to_cpu = (  # type: ignore[assignment]
        lambda t, as_numpy=False, record_stream=False:
        t.numpy() if as_numpy and torch.is_tensor(t) else t)
    # fused_softmax.get_default_causal_mask: hard-codes device="cuda".
    fused_softmax.get_default_causal_mask = (  # type: ignore[assignment]
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1))
    # tensor_parallel.random._get/_set_cuda_rng_state and CudaRNGStatesTracker.add: the model-
    # parallel RNG tracker and activation-checkpoint RNG save/restore use the CPU generator.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mp_random.CudaRNGStatesTracker.add = _tracker_add  # type: ignore[method-assign]
    # optimizer.clip_grads.clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor;
    # megatron.core.optimizer.optimizer imported the name, so patch it there too.
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = _clip_by_total_norm


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for p in parameters:
        g = getattr(p, attr, None)
        if g is not None:
            g.detach().mul_(coeff)


def _tracker_add(self, name: str, seed: int) -> None:
    """CPU version of megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add."""
    self._is_initialized = True
    if seed in self.seeds_ or name in self.states_:
        raise ValueError(f"rng state {name}/{seed} already exists")
    self.seeds_.add(seed)
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


def apply_cpu_shims() -> bool:
    """Apply the shims if torch has no CUDA; returns whether they are active. Idempotent."""
    if torch.cuda.is_available():
        return False
    _patch_torch_cuda()
    _patch_megatron()
    return True


@contextlib.contextmanager
def cuda_tensor_type_names():
    """While megatron builds its optimizer, CPU tensors report CUDA type names.

    megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__ sorts params by
    `Tensor.type()` in ('torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor', 'torch.cuda.
    FloatTensor') and rejects anything else (bf16 training on CPU). No-op when CUDA exists.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_name(self, dtype=None, *args, **kwargs):
        if dtype is None and not args and not kwargs:
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, *args, **kwargs)

    torch.Tensor.type = type_name  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]
