"""The loss is one global normaliser over the data-parallel ranks (issue 28): two gloo ranks
with unequal token counts, whose gradients are averaged as DDP/FSDP2 average them, give the same
gradient as one rank over all samples, in every aggregation mode, through trainer.grpo's step."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import TrainerConfig
from trainer.grpo import GRPOStep
from trainer.replay import AgreementStats
from trainer.samples.batch import Sample, split_microbatches

V = 7
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class _Backend:
    """The TrainBackend surface GRPOStep uses: an embedding 'model' whose gradients are
    averaged over the ranks after the backward passes, as megatron DDP and FSDP2 do."""

    padded, moe_layers, num_experts, top_k = 0, (), 1, 1

    def __init__(self, cfg: TrainerConfig, world: int) -> None:
        self.cfg, self.data_parallel_size = cfg, world
        torch.manual_seed(0)
        self.model = torch.nn.Embedding(V, V)
        self.agreement = AgreementStats((), 1)
        self.grad: torch.Tensor | None = None

    def microbatches(self, samples):
        return split_microbatches(samples, 2, 4)

    def no_grad_pass(self, mbs, mode, reference):
        return nullcontext()

    def logits(self, mb, mode, reference=False):
        return self.model(mb.tokens_BS)

    def update(self, mbs, mode, loss_fn) -> float:
        self.model.zero_grad()
        for mb in mbs:
            loss_fn(mb, self.model(mb.tokens_BS)).backward()
        g = self.model.weight.grad
        assert g is not None
        if dist.is_initialized():
            dist.all_reduce(g)
            g /= dist.get_world_size()
        self.grad = g.clone()
        return float(g.norm())


def _samples(rng: np.random.Generator, group: str, lengths: list[int]) -> list[Sample]:
    out = []
    for i, r in enumerate(lengths):
        tokens = rng.integers(0, V, 3 + r)
        out.append(Sample(tokens, 3, rng.normal(-2, 0.5, r).astype(np.float32),
                          np.ones(r, bool), reward=float(i % 2), group_id=group))
    return out


def _groups() -> tuple[list[Sample], list[Sample]]:
    rng = np.random.default_rng(0)
    return _samples(rng, "long", [9, 7]), _samples(rng, "short", [1, 2])  # 16 vs 3 tokens


def _grads(world: int, share: list[Sample]) -> dict[str, torch.Tensor]:
    out = {}
    for mode in MODES:
        cfg = TrainerConfig.model_validate({
            "replay": {"mode": "off", "check_agreement": False},
            "data": {"old_logprobs": "rollout"},
            "loss": {"agg_mode": mode, "agg_norm_len": 5, "clip_ratio_c": None}})
        backend = _Backend(cfg, world)
        GRPOStep(backend).train_step([Sample(**vars(s)) for s in share])  # type: ignore[arg-type]
        assert backend.grad is not None
        out[mode] = backend.grad
    return out


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.save(_grads(2, list(_groups()[rank])), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_unequal_tokens_equal_one_rank(tmp_path: Path) -> None:
    long, short = _groups()
    want = _grads(1, long + short)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = (str(tmp_path / "store"), str(tmp_path / "g"))
    # both ranks in spawned children: this process may already hold a default process group
    # (an in-process trainer of an earlier test on the same pytest worker)
    ranks = [mp.get_context("spawn").Process(target=_rank, args=(r, *args)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout=120)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"g.{rank}")
        for mode in MODES:
            assert torch.allclose(got[mode], want[mode], atol=1e-6), mode
    # what it replaces, each rank's own mean averaged over the ranks, is another gradient
    local = (_grads(1, long)["token-mean"] + _grads(1, short)["token-mean"]) / 2
    assert not torch.allclose(local, want["token-mean"], atol=1e-3)
