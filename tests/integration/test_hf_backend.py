"""The HF/FSDP2 trainer backend (trainer.hf) on the tiny Qwen3-MoE, against plain transformers and
against the megatron-core trainer (same weights, same batch, same replayed routing).

Rollout samples come from a plain transformers forward of the same checkpoint (a perfect fp32
engine); "random" routing replaces the natural ids with random distinct ids (rollout logprobs
then stay the natural ones: those tests compare trainers with each other, not with the engine).
Legend: B batch, S sequence, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from services.common.net import free_port
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from tests.support.replay_rows import RowsAlive
from trainer.replay import ReplayMode

pytestmark = pytest.mark.timeout(300)

ENGINE_LAYERS = (0, 1)
E, K = 8, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig())


@pytest.fixture(scope="module")
def plain(model_dir):  # loaded before any process group exists
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _cfg(model_dir, **kw):
    from trainer.config import TrainerConfig

    base = dict(model_dir=str(model_dir), data={"micro_batch_size": 2}, optim={"lr": 1e-4},
                replay={"agreement_floor": 0.9})
    return TrainerConfig.model_validate(base | kw)


@pytest.fixture(scope="module")
def megatron(model_dir, plain):
    from trainer.backend import make_trainer

    return {dt: make_trainer(_cfg(model_dir, model={"dtype": dt})) for dt in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def hf_trainer(model_dir, megatron):  # after megatron: shares its 1-rank process group
    from trainer.backend import make_trainer

    return make_trainer(_cfg(model_dir, backend="hf", loss={"kl_coef": 0.05}))


def make_samples(plain, n=4, seed=0, routing="natural", prompt_len=6):
    from trainer.samples.alignment import LayerMap
    from trainer.samples.batch import Sample

    rng = np.random.default_rng(seed)
    lm = LayerMap.build((0, 1), ENGINE_LAYERS)
    out = []
    for i in range(n):
        r = int(rng.integers(4, 10))
        toks = torch.from_numpy(rng.integers(4, 90, prompt_len + r)).unsqueeze(0)
        with torch.no_grad():
            o = plain(toks, output_router_logits=True, use_cache=False)
        nat_TLK = torch.stack([x.topk(K, -1).indices for x in o.router_logits], 1).numpy()
        if routing == "random":
            nat_TLK = np.stack([rng.permutation(E)[:K] for _ in range(nat_TLK.shape[0] * 2)])
            nat_TLK = nat_TLK.reshape(-1, 2, K)
        lp = torch.log_softmax(o.logits[0].float(), -1)[:-1].gather(-1, toks[0, 1:, None])[:, 0]
        out.append(Sample(toks[0].numpy(), prompt_len, lp[prompt_len - 1:].numpy(),
                          np.ones(r, bool), float(rng.random()), f"g{i % 2}",
                          routing_TLK=lm.select(nat_TLK[:-1])))
    return out


def reload(tr, model_dir):
    """Put the checkpoint weights back into an (unsharded) HF trainer's policy."""
    from trainer.hf.model import load_model

    tr.backend.model.load_state_dict(load_model(model_dir).state_dict())


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


# ---------------------------------------------------------------- tests
def test_r3_natural_routing_agreement_and_logprobs(hf_trainer, plain, model_dir):
    reload(hf_trainer, model_dir)
    mbs = hf_trainer.prepare(make_samples(plain, n=5, seed=1))
    assert mbs[0].tokens_BS.shape[0] == 1  # packed
    m = hf_trainer.old_policy_pass(mbs, ReplayMode.R3)
    assert m["routing_agreement"] == 1.0 and set(m["routing_agreement_by_layer"]) == {0, 1}
    assert m["logprob_diff_mean"] < 1e-5


def test_shifted_routing_is_caught(hf_trainer, plain, model_dir):
    from trainer.replay import RoutingAgreementError

    reload(hf_trainer, model_dir)
    samples = make_samples(plain, seed=2)
    for s in samples:  # off by one row
        s.routing_TLK = np.concatenate([s.routing_TLK[1:], s.routing_TLK[-1:]])
    with pytest.raises(RoutingAgreementError, match=r"HF layer \d"):
        hf_trainer.old_policy_pass(hf_trainer.prepare(samples), ReplayMode.R3)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_megatron_and_hf_logprobs_agree_under_same_routing(dtype, megatron, model_dir, plain,
                                                           request):
    from trainer.backend import make_trainer

    tr = request.getfixturevalue("hf_trainer") if dtype == "fp32" else \
        make_trainer(_cfg(model_dir, backend="hf", model={"dtype": "bf16"}))
    if dtype == "fp32":
        reload(tr, model_dir)
    samples = make_samples(plain, n=6, seed=3, routing="random")
    mc = megatron[dtype].sample_logprobs(samples, "r3")
    hf = tr.sample_logprobs(samples, "r3")
    d = np.concatenate([np.abs(a - b) for a, b in zip(mc, hf, strict=True)])
    print(f"{dtype}: megatron vs hf |logprob diff| mean {d.mean():.3g} max {d.max():.3g}")
    if dtype == "fp32":
        assert d.max() < 1e-4
    else:
        assert tr.backend.sharded and d.mean() < 0.02 and d.max() < 0.08


def test_grpo_step_r3_with_replaying_reference(hf_trainer, plain, model_dir):
    reload(hf_trainer, model_dir)
    first = hf_trainer.train_step(make_samples(plain, n=6, seed=4))
    second = hf_trainer.train_step(make_samples(plain, n=6, seed=4))
    for k in ("grad_norm", "entropy", "loss", "ppo_kl", "kl_ref", "clip_ratio"):
        assert np.isfinite(first[k]) and np.isfinite(second[k]), k
    assert first["grad_norm"] > 0 and first["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert second["kl_ref"] > 0 and second["routing_agreement"] < 1.0 + 1e-9
    assert second["policy_version"] == first["policy_version"] + 1
    assert second["logprob_diff_mean"] > first["logprob_diff_mean"]  # weights moved off HF
    assert hf_trainer.backend.routers[0].module.weight.grad is not None  # gradients reach the router


def test_objectives_tis_gspo_take_a_step(hf_trainer, plain, model_dir):
    """trainer.losses.objectives' choices through the hf backend (packed micro-batches)."""
    reload(hf_trainer, model_dir)
    saved = hf_trainer.cfg.loss
    hf_trainer.cfg.loss = saved.model_copy(update={
        "ratio_level": "sequence", "agg_mode": "seq-mean-token-sum-norm",
        "rollout_correction": saved.rollout_correction.model_copy(
            update={"is_level": "token", "mask_level": "geometric"})})
    try:
        m = hf_trainer.train_step(make_samples(plain, n=6, seed=4))
    finally:
        hf_trainer.cfg.loss = saved
    for k in ("grad_norm", "loss", "is_weight_mean", "is_truncated_share", "mismatch_kl"):
        assert np.isfinite(m[k]), k
    assert m["grad_norm"] > 0


def test_r2_update_replays_old_policy_routing_after_weight_change(hf_trainer, plain, model_dir):
    reload(hf_trainer, model_dir)
    mbs = hf_trainer.prepare(make_samples(plain, seed=5))
    hf_trainer.compute_logprobs(mbs, "r2")
    recorded = [t for mb in mbs for t in mb.replay_rows]
    with torch.no_grad():
        for r in hf_trainer.backend.routers:
            r.module.weight.add_(torch.randn_like(r.module.weight))
    used: list[torch.Tensor] = []
    hooks = [b.experts.register_forward_pre_hook(lambda mod, a: used.append(a[1].clone()))
             for b in moe_blocks(hf_trainer.backend.model)]
    try:
        hf_trainer.compute_logprobs(mbs, "off")
        natural, used[:] = list(used), []
        hf_trainer.backend.update(mbs, ReplayMode.R2, lambda mb, logits: logits.float().mean() * 0)
    finally:
        for h in hooks:
            h.remove()
    assert len(used) == len(recorded)
    assert all(torch.equal(u, w) for u, w in zip(used, recorded, strict=True))
    assert any(not torch.equal(n, w) for n, w in zip(natural, recorded, strict=True))
    reload(hf_trainer, model_dir)


def test_sft_step_lowers_loss_and_export_round_trips(hf_trainer, plain, model_dir):
    from safetensors.torch import load_file

    reload(hf_trainer, model_dir)
    ref = load_file(str(model_dir / "model.safetensors"))
    out = hf_trainer.export_hf_state_dict()
    assert set(out) == set(ref) and all(torch.equal(out[k], ref[k]) for k in ref)
    samples = make_samples(plain, seed=6)
    losses = [hf_trainer.sft_step(samples)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    reload(hf_trainer, model_dir)


def test_warns_when_kl_reference_does_not_replay(model_dir, megatron, caplog):
    from trainer.backend import make_trainer

    with caplog.at_level(logging.WARNING, logger="trainer.hf.engine"):
        tr = make_trainer(_cfg(model_dir, backend="hf", loss={"kl_coef": 0.1},
                               hf={"reference_replay": False}))
    assert tr.backend.ref_replay is None
    assert "reference routes naturally" in caplog.text


# ---------------------------------------------------------------- two ranks, FSDP2 over gloo
def _fsdp_rank(rank, world, port, model_dir, shares, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from trainer.backend import make_trainer

    tr = make_trainer(_cfg(model_dir, backend="hf"))
    before = tr.export_hf_state_dict()  # rank 0 only: the others get {}
    m = tr.train_step(shares[rank], "r3")
    after = tr.export_hf_state_dict()
    res = {"sharded": tr.backend.sharded, "grad_norm": m["grad_norm"],
           "agreement": m["routing_agreement"], "moved": max(
               (float((after[k] - before[k]).abs().max()) for k in before), default=0.0),
           "exported": len(after)}
    # the streamed export (one parameter gathered at a time) reaches rank 0 only, equal, and
    # gathers to rank 0 alone: no all-gather (DTensor.full_tensor) on the way
    from torch.distributed.tensor import DTensor

    def no_all_gather(self):  # noqa: ANN001, ANN202
        raise AssertionError("the streamed export all-gathered a parameter")
    full_tensor, DTensor.full_tensor = DTensor.full_tensor, no_all_gather
    try:
        streamed = [(k, v.cpu()) for k, v in tr.backend.iter_hf_weights(sender=0)]
    finally:
        DTensor.full_tensor = full_tensor
    res["stream_equal"] = (sorted(k for k, _ in streamed) == sorted(after) and all(
        torch.equal(v, after[k]) for k, v in streamed)) if rank == 0 else streamed == []
    if rank == 0:
        torch.save(after, os.path.join(out_dir, "after.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_two_cpu_ranks_fsdp2_gloo_take_a_step(model_dir, plain, megatron, tmp_path):
    import torch.multiprocessing as mp

    from trainer.backend import make_trainer

    shares = [make_samples(plain, n=4, seed=7), make_samples(plain, n=4, seed=8)]
    for s in shares[1]:  # distinct groups on the two ranks
        s.group_id = "h" + s.group_id[1:]
    mp.spawn(_fsdp_rank, args=(2, free_port(), str(model_dir), shares, str(tmp_path)),
             nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"]
    assert r0["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-6) and r0["grad_norm"] > 0
    assert r0["agreement"] == 1.0 and r1["agreement"] == 1.0
    assert r0["moved"] > 0 and r0["exported"] > 0 and r1["exported"] == 0
    assert r0["stream_equal"] and r1["stream_equal"]
    # one in-process rank (after `megatron`: its 1-rank group) on both shares: the same step
    one = make_trainer(_cfg(model_dir, backend="hf"))
    m = one.train_step(shares[0] + shares[1], "r3")
    assert m["grad_norm"] == pytest.approx(r0["grad_norm"], rel=1e-5)
    two, after = torch.load(tmp_path / "after.pt"), one.export_hf_state_dict()
    assert max(float((after[k] - two[k]).abs().max()) for k in two) < 1e-5


# ---------------------------------------------------------------- sequence parallelism (Ulysses)
def _sp_rank(rank, world, port, model_dir, shares, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from trainer.backend import make_trainer

    tr = make_trainer(_cfg(model_dir, backend="hf", hf={"sequence_parallel": 2}))
    b = tr.backend
    mbs = b.microbatches(shares[rank])  # the group's union: both ranks the same rows
    with torch.no_grad(), b.no_grad_pass(mbs, ReplayMode.R3, reference=False):
        logits = [b.logits(mb, ReplayMode.R3).cpu() for mb in mbs]
    m = tr.train_step(shares[rank], "r3")
    after = tr.export_hf_state_dict()
    res = {"grad_norm": m["grad_norm"], "agreement": m["routing_agreement"],
           "dp": b.data_parallel_size, "tokens": [int(mb.tokens_BS.shape[1]) for mb in mbs]}
    torch.save({"logits": logits, "after": after}, os.path.join(out_dir, f"sp{rank}.pt"))
    with open(os.path.join(out_dir, f"sp{rank}.json"), "w") as f:
        json.dump(res, f)


def test_sequence_parallel_two_ranks_equal_one_rank(model_dir, plain, megatron, tmp_path):
    """hf.sequence_parallel 2: two gloo ranks run the union of their shares, each on half of
    every packed row (Ulysses attention); logits before the step, the r3 step's grad norm and
    the weights after it equal one rank's on all the samples (fp32)."""
    import torch.multiprocessing as mp

    from trainer.backend import make_trainer

    shares = [make_samples(plain, n=4, seed=7), make_samples(plain, n=4, seed=8)]
    for s in shares[1]:
        s.group_id = "h" + s.group_id[1:]
    mp.spawn(_sp_rank, args=(2, free_port(), str(model_dir), shares, str(tmp_path)),
             nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"sp{r}.json").read_text()) for r in (0, 1))
    assert r0["dp"] == 1 and r0["tokens"] == r1["tokens"]
    assert r0["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-6) and r0["grad_norm"] > 0
    assert r0["agreement"] == 1.0 and r1["agreement"] == 1.0
    one = make_trainer(_cfg(model_dir, backend="hf"))
    b = one.backend
    mbs = b.microbatches(shares[0] + shares[1])
    assert [int(mb.tokens_BS.shape[1]) for mb in mbs] == r0["tokens"]
    with torch.no_grad(), b.no_grad_pass(mbs, ReplayMode.R3, reference=False):
        want = [b.logits(mb, ReplayMode.R3) for mb in mbs]
    sp0, sp1 = (torch.load(tmp_path / f"sp{r}.pt") for r in (0, 1))
    diff = 0.0
    for got0, got1, w in zip(sp0["logits"], sp1["logits"], want, strict=True):
        assert torch.equal(got0, got1)
        diff = max(diff, float((got0 - w).abs().max()))
    assert diff < 1e-5
    m = one.train_step(shares[0] + shares[1], "r3")
    assert m["grad_norm"] == pytest.approx(r0["grad_norm"], rel=1e-5)
    after = one.export_hf_state_dict()
    moved = max(float((after[k] - sp0["after"][k]).abs().max()) for k in after)
    print(f"sequence parallel 2 vs 1 rank: max |d logit| {diff:.1e}, grad norm "
          f"{r0['grad_norm']:.6f} vs {m['grad_norm']:.6f}, max |d weight| {moved:.1e}")
    assert moved < 1e-5 and sp1["after"] == {}


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_int64_replay_rows_alive_do_not_grow_with_micro_batches(hf_trainer, plain, model_dir,
                                                                  mode):
    """Issue 54, as test_trainer_megatron's: the int64 ids the routers replay (each tensor's
    base: the replay keeps a per-rank slice of it) are at most one micro-batch's at any router
    forward, with 4 samples' micro-batches as with 8 (kept for the step, they held them all)."""
    reload(hf_trainer, model_dir)
    b = hf_trainer.backend
    samples = make_samples(plain, n=8, seed=9)
    counts = []
    for n in (4, 8):
        mbs = hf_trainer.prepare(samples[:n])
        one_mb = max(mb.tokens_BS.numel() for mb in mbs) * len(b.moe_layers) * K * 8
        with RowsAlive([r.module for r in b.routers], lambda _: b.replay._ids) as rows:
            hf_trainer.compute_logprobs(mbs, mode)
            b.update(mbs, ReplayMode(mode), lambda mb, logits: logits.float().mean() * 0)
        counts.append(len(mbs))
        assert 0 < rows.peak <= one_mb, (n, rows.peak, one_mb)
    assert counts[1] > counts[0] > 1
