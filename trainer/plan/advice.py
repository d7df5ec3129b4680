"""What to change when a plan does not fit: the largest rows of the per-rank table, each with
the setting that shrinks it (the trainer config's field names, megatron or hf backend)."""

from __future__ import annotations

from typing import Protocol

GiB = 1 << 30


class Layout(Protocol):
    """What of trainer.plan.layout.Layout the advice reads."""

    @property
    def fsdp(self) -> bool: ...
    @property
    def distributed_optimizer(self) -> bool: ...
    @property
    def chunked_logprobs(self) -> bool: ...

_HF_MODEL = "more ranks per weight: run.world_size (hf.sharding full)"
# replay keeps every micro-batch of a step's routing: fewer sequences per rank and step
_REPLAY = "data.groups_per_step or more data-parallel ranks (run.world_size)"


def _model(dense_heavy: bool) -> str:
    """Where more model parallelism helps: the rank's dense part (attention, dense MLPs,
    embeddings) splits over TP and PP, its experts over EP."""
    if dense_heavy:
        return "split the dense part further: model.tensor_parallel, model.pipeline_parallel"
    return "split the experts further: model.expert_parallel (or model.pipeline_parallel)"


def _setting(row: str, lay: Layout, dense_heavy: bool) -> str | None:
    """The setting that shrinks `row` under `lay`, or None when there is none to name."""
    if lay.fsdp:
        return {"weights": _HF_MODEL, "grads": _HF_MODEL, "optimizer": _HF_MODEL,
                "activations": "hf.gradient_checkpointing: true, or a shorter sequence",
                "attention scores": "hf.attn_implementation: sdpa",
                "logits + loss": "loss.chunked_logprobs: true",
                "reference model": "loss.kl_coef: 0 (no reference model)",
                "replay ids": _REPLAY,
                "replay rows": "data.micro_batch_size, or a shorter sequence"}.get(row)
    model = _model(dense_heavy)
    fixes = {
        "weights": model, "grads": model,
        "optimizer": model if lay.distributed_optimizer
        else "optim.use_distributed_optimizer: true",
        "reference model": "loss.kl_coef: 0 (no reference model), or " + model,
        "activations": "model.recompute_granularity: full, model.context_parallel, or a "
                       "shorter sequence",
        "attention scores": "model.attention: sdpa",
        "attention buffer": "model.attention: sdpa",
        "logits + loss": None if lay.chunked_logprobs else "loss.chunked_logprobs: true",
        "weight push": "weight_sync.bucket_bytes, weight_sync.inflight_buckets",
        "replay ids": _REPLAY,
        "replay rows": "data.micro_batch_size, or model.context_parallel (each rank replays its "
                       "shard)",
    }
    return fixes.get(row)


def what_to_change(rows: dict[str, float], excess: float, lay: Layout, dense_heavy: bool,
                   top: int = 2) -> str:
    """One line: by how much (`excess` bytes) a plan does not fit, and its `top` largest
    `rows` that a setting shrinks, with that setting (`dense_heavy`: the rank holds more dense
    than expert parameters)."""
    named = [(v, r, s) for r, v in rows.items() if v and (s := _setting(r, lay, dense_heavy))]
    parts = "; ".join(f"{r} {v / GiB:.2f} GiB: {s}" for v, r, s in sorted(named)[::-1][:top])
    return (f"does not fit by {excess / GiB:.2f} GiB; to change: "
            f"{parts or 'a GPU with more memory'}")
