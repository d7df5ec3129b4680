"""optim.overlap_param_gather: the distributed optimizer's parameter all-gather, left by the
optimizer step to later (megatron-core 0.19 DistributedDataParallel, `overlap_param_gather`).

After a step each data-parallel rank holds only its own shard of the updated parameters; the
rest of every parameter is the previous step's until its bucket group is all-gathered. megatron
DDP's forward pre-hooks, registered on every submodule of the module it wraps (so they also run
on the no-grad passes, which call that module directly), wait for a parameter's bucket group
before the module that holds it runs. Two ways to start the gathers (optim.param_gather_dispatch):
  * forward: megatron's chain; the first module's hook gathers its group and each finished
    group starts the next one (one gather in flight, beside the previous group's compute);
  * step: `start_param_gather` right after the optimizer step starts every group's gather, in
    forward order (the embedding's first), so they also run during the host work before the
    next forward; the hooks only wait.
Readers of the parameters that are not a forward (export, weight push, checkpoint) call
`finish_param_gather` first. Every call here is a collective over each group's DP ranks, made
in the same order on every rank.
"""

from __future__ import annotations

from typing import Any

import torch


def overlapped(ddp: Any) -> bool:
    return bool(ddp.ddp_config.overlap_param_gather)


def finish_param_gather(ddp: Any) -> None:
    """Every bucket group gathered, by megatron's own per-group finish (the one its pre-hook
    calls): a group not yet started is gathered, one in flight waited for, one already gathered
    left alone. A no-op without the overlap."""
    if not overlapped(ddp):
        return
    with torch.no_grad():
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)


def dispatch_at_step(ddp: Any) -> None:
    """param_gather_dispatch: step. The pre-hooks then only wait (megatron's flag for gathers
    the optimizer step started: `overlap_param_gather_with_optimizer_step`, which is also what
    makes DDP.start_param_sync without force_* a no-op)."""
    ddp.overlap_param_gather_with_optimizer_step = True


def start_param_gather(ddp: Any) -> None:
    """param_gather_dispatch: step, after a step that was applied: start every group's gather,
    asynchronously, in forward order (megatron orders buckets backward: the last group holds
    the first layers). A group still in flight from before (a forward that never reached its
    parameters) is finished first."""
    if not getattr(ddp, "overlap_param_gather_with_optimizer_step", False):
        return
    with torch.no_grad():
        for groups in (ddp.bucket_groups, ddp.expert_parallel_bucket_groups):
            for group in reversed(groups):
                if group.param_gather_handle is not None:
                    group.finish_param_sync(skip_next_bucket_dispatch=True)
                group.start_param_sync()
