"""`auto` fast-path switches (issue 42): the trainer and `r3flow plan` decide them the same way
(TrainerConfig.fast_path): grouped experts, SDPA, planned dispatch, fused Adam and the chunked
log-softmax on CUDA with dtype bf16, the reference path on CPU or in fp32; explicit settings
stay. The megatron trainer logs the path it runs once at start (on CPU: reference)."""

from __future__ import annotations

import pytest

from trainer.config import TrainerConfig

FAST = ("grouped", "sdpa", True, True, True)
REFERENCE = ("sequential", "unfused", False, False, False)


def _switches(cfg: TrainerConfig) -> tuple:
    m = cfg.model
    return (m.experts, m.attention, m.planned_dispatch, cfg.optim.fused_adam,
            cfg.loss.chunked_logprobs)


def test_defaults_are_auto_and_resolve_by_device_and_dtype():
    cfg = TrainerConfig()
    assert _switches(cfg) == ("auto",) * 5
    bf16 = TrainerConfig(model={"dtype": "bf16"})
    assert _switches(bf16.fast_path(cuda=True)) == FAST
    assert _switches(bf16.fast_path(cuda=False)) == REFERENCE
    assert _switches(cfg.fast_path(cuda=True)) == REFERENCE  # fp32: the reference
    assert "trainer path: fast " in bf16.fast_path(cuda=True).describe_path()
    assert "trainer path: reference " in bf16.fast_path(cuda=False).describe_path()
    # idempotent: a resolved config resolves to itself
    once = bf16.fast_path(cuda=True)
    assert _switches(once.fast_path(cuda=False)) == FAST


def test_explicit_settings_are_kept_and_unsupported_layouts_fall_back():
    ref = TrainerConfig(model={"dtype": "bf16", "experts": "sequential", "attention": "unfused",
                               "planned_dispatch": False}, optim={"fused_adam": False},
                        loss={"chunked_logprobs": False})
    assert _switches(ref.fast_path(cuda=True)) == REFERENCE
    assert "trainer path: reference " in ref.fast_path(cuda=True).describe_path()
    cpu_fast = TrainerConfig(model={"experts": "grouped", "attention": "sdpa"})
    assert _switches(cpu_fast.fast_path(cuda=False))[:2] == ("grouped", "sdpa")
    odd = TrainerConfig(model={"dtype": "bf16", "expert_tensor_parallel": 2,
                               "dispatcher": "allgather"})
    m = odd.fast_path(cuda=True).model
    assert (m.experts, m.planned_dispatch) == ("sequential", False)
    assert "trainer path: mixed " in odd.fast_path(cuda=True).describe_path()
    gpt_oss = TrainerConfig(model={"dtype": "bf16"}).fast_path(cuda=True, family="gpt_oss")
    assert gpt_oss.model.experts == "sequential"


def test_planned_dispatch_true_still_needs_alltoall():
    with pytest.raises(ValueError, match="planned_dispatch: needs dispatcher alltoall"):
        TrainerConfig(model={"planned_dispatch": True, "dispatcher": "allgather"})
    TrainerConfig(model={"planned_dispatch": "auto", "dispatcher": "allgather"})


def test_plan_decides_auto_as_the_pods_device(tmp_path):
    from trainer.plan.manifest import layout_from_trainer

    cfg = TrainerConfig(model={"dtype": "bf16"})
    gpu, cpu = layout_from_trainer(cfg, 4096, True), layout_from_trainer(cfg, 4096, False)
    assert (gpu.attention, gpu.chunked_logprobs) == ("sdpa", True)
    assert (cpu.attention, cpu.chunked_logprobs) == ("unfused", False)


def test_megatron_trainer_logs_the_reference_path_on_cpu(tmp_path):
    """A bf16 trainer with no switches set, on CPU (a fresh interpreter: the trainer sets up
    torch.distributed and megatron's CPU shims): one start line names the reference path."""
    from tests.support.trainer_path import start_bf16_trainer

    lines, stdout = start_bf16_trainer(tmp_path / "tiny", gpu=False, timeout=300)
    assert len(lines) == 1, stdout[-3000:]
    assert lines[0].startswith("trainer.megatron.engine trainer path: reference "), lines
    assert "RESOLVED sequential unfused False False False" in stdout


def test_logprob_kernel_is_triton_where_the_chunked_path_runs_on_cuda():
    """Issue 44: loss.logprob_kernel auto -> triton with the chunked log-softmax on CUDA, torch
    on CPU, in fp32 (chunked off) or when set; the start line names it."""
    bf16 = TrainerConfig(model={"dtype": "bf16"})
    assert bf16.fast_path(cuda=True).loss.logprob_kernel == "triton"
    assert "logprob_kernel triton)" in bf16.fast_path(cuda=True).describe_path()
    assert bf16.fast_path(cuda=False).loss.logprob_kernel == "torch"
    assert TrainerConfig().fast_path(cuda=True).loss.logprob_kernel == "torch"
    pinned = TrainerConfig(model={"dtype": "bf16"}, loss={"logprob_kernel": "torch"})
    assert pinned.fast_path(cuda=True).loss.logprob_kernel == "torch"
    with pytest.raises(ValueError, match="logprob_kernel"):
        TrainerConfig(loss={"logprob_kernel": "cuda"})
