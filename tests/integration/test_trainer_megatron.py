"""The megatron-core trainer on CPU (real megatron-core 0.19.2, gloo, 1 rank) against HF.

One tiny Qwen3-MoE (3 layers, layer 0 dense) and one fp32 Trainer are shared by the module;
tests that compare against HF reload the checkpoint weights first.
Legend: B batch, S sequence, L layers, K top-k, E experts, T rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from tests.support.replay_rows import RowsAlive
from trainer.replay import ReplayMode

pytestmark = pytest.mark.timeout(300)

ENGINE_LAYERS = (0, 1, 2)  # engines report every hidden layer, the dense one included


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=3,
                                                                        first_k_dense=1))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def trainer(model_dir, hf):  # hf first: it must load before megatron's process group exists
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    cfg = TrainerConfig(model_dir=str(model_dir), loss={"kl_coef": 0.05},
                        data={"micro_batch_size": 2}, optim={"lr": 1e-4},
                        replay={"agreement_floor": 0.9})
    return make_trainer(cfg)


# ---------------------------------------------------------------- HF reference (test helpers)
def load_hf(model_dir):
    """HF model in fp32. transformers 5 may leave the non-persistent RoPE buffers uninitialised
    when a process group exists, so they are recomputed here."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rope = hf.model.rotary_emb
    inv, _ = rope.compute_default_rope_parameters(hf.config)
    rope.inv_freq.copy_(inv)
    rope.original_inv_freq.copy_(inv)
    return hf


def hf_moe_gates(hf):
    return [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]


def hf_forward(hf, tokens_BS, forced_BSLK=None):
    """HF logits and natural top-k [B, S, L_moe, K]; with `forced_BSLK` HF's top-k choice is
    replaced by the given ids (gate weights recomputed from the live logits, as R3 does)."""
    handles = []
    if forced_BSLK is not None:
        flat = forced_BSLK.reshape(-1, forced_BSLK.shape[2], forced_BSLK.shape[3]).long()
        for m, gate in enumerate(hf_moe_gates(hf)):
            def hook(mod, inp, out, m=m):
                logits = out[0]
                ids = flat[:, m]
                w = torch.softmax(logits.float().gather(-1, ids), -1).to(logits.dtype)
                return logits, w, ids
            handles.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = hf(tokens_BS, output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    b, s = tokens_BS.shape
    k = hf.config.num_experts_per_tok
    nat = torch.stack([r.view(b, s, -1).topk(k, -1).indices for r in out.router_logits], 2)
    return out.logits, nat


def make_samples(hf, n=4, prompt_len=6, seed=0, routing="natural", groups=2):
    """Samples whose rollout routing / logprobs come from HF (a perfect fp32 engine)."""
    from trainer.samples.alignment import LayerMap
    from trainer.samples.batch import Sample

    rng = np.random.default_rng(seed)
    lm = LayerMap.build((1, 2), ENGINE_LAYERS)
    out = []
    for i in range(n):
        r = int(rng.integers(4, 10))
        toks = torch.from_numpy(rng.integers(4, 100, prompt_len + r)).unsqueeze(0)
        forced = None
        if routing == "random":
            forced = torch.from_numpy(np.stack([rng.permutation(8)[:2] for _ in
                                                range(toks.shape[1] * 2)])).view(1, -1, 2, 2)
        logits, nat = hf_forward(hf, toks, forced)
        used = forced if forced is not None else nat
        lp = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, toks[0, 1:, None])[:, 0]
        # the dense layer's column holds plausible ids (dropped by the layer map)
        engine_TLK = np.stack([rng.permutation(8)[:2] for _ in range((toks.shape[1] - 1) * 3)])
        engine_TLK = engine_TLK.reshape(-1, 3, 2)
        engine_TLK[:, 1:] = used[0, :-1].numpy()
        out.append(Sample(toks[0].numpy(), prompt_len, lp[prompt_len - 1:].numpy(),
                          np.ones(r, bool), float(rng.random()), f"g{i % groups}",
                          routing_TLK=lm.select(engine_TLK)))
    return out


def capture_routing(trainer):
    """Router forward hook recording (action, chosen expert sets [T, K]) per call."""
    calls = []

    def hook(router, inp, out):
        rm = out[1].bool()
        sets = rm.nonzero()[:, 1].view(rm.shape[0], -1).sort(-1).values
        calls.append((router.router_replay.router_replay_action, router.layer_number, sets))
    handles = [r.register_forward_hook(hook) for r in trainer.backend.policy.routers]
    return calls, handles


def reload(trainer, model_dir):
    from trainer.megatron.model import load_hf_weights

    load_hf_weights(trainer.backend.policy, model_dir)


# ---------------------------------------------------------------- tests
def test_round_trip_hf_megatron_hf_is_exact(trainer, model_dir):
    from safetensors.torch import load_file

    reload(trainer, model_dir)
    ref = load_file(str(model_dir / "model.safetensors"))
    out = trainer.export_hf_state_dict()
    assert set(out) == set(ref)
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def test_router_dtype_auto_is_resolved_to_the_engines_at_boot(trainer):
    assert trainer.cfg.model.router_dtype == "native"  # qwen3_moe: vLLM's gate dtype
    assert trainer.backend.policy.config.moe_router_dtype is None  # megatron: router in model dtype


def test_logits_match_hf_under_same_forced_routing(trainer, hf, model_dir):
    from trainer.samples.alignment import to_router_rows

    reload(trainer, model_dir)
    rng = np.random.default_rng(3)
    tokens = torch.from_numpy(rng.integers(4, 100, (2, 12)))
    forced = torch.from_numpy(np.stack([rng.permutation(8)[:2] for _ in range(2 * 12 * 2)]))
    forced = forced.view(2, 12, 2, 2)
    hf_logits, natural = hf_forward(hf, tokens, forced)
    assert not torch.equal(natural.sort(-1).values, forced.sort(-1).values)
    trainer.backend.replay.replay_forward(to_router_rows(forced))
    with torch.no_grad():
        mc = trainer.backend.policy.module(input_ids=tokens, position_ids=torch.arange(12).expand(2, 12),
                                   attention_mask=None)
    trainer.backend.replay.end_step()
    torch.testing.assert_close(mc, hf_logits, atol=1e-4, rtol=1e-4)


def test_r3_replays_exactly_the_rollout_routing(trainer, hf, model_dir):
    from trainer.samples.alignment import to_router_rows

    reload(trainer, model_dir)
    samples = make_samples(hf, routing="random", seed=1)
    mbs = trainer.prepare(samples)
    calls, handles = capture_routing(trainer)
    try:
        lps = trainer.compute_logprobs(mbs, "r3")
    finally:
        for h in handles:
            h.remove()
    for j, mb in enumerate(mbs):  # agreement of the used routing with the replay data: 1.0
        want = [r.sort(-1).values for r in to_router_rows(mb.routing_BSLK)]
        assert all(torch.equal(calls[2 * j + m][2], want[m]) for m in range(2))
        diff = (lps[j] - mb.old_logprobs_BS).abs()[mb.loss_mask_BS.bool()]
        assert diff.max() < 1e-4  # rollout logprobs = HF with the same forced routing


def test_sample_logprobs_follow_input_order(trainer, hf, model_dir):
    reload(trainer, model_dir)
    samples = make_samples(hf, n=5, routing="random", seed=11)
    lps = trainer.sample_logprobs(samples, "r3")
    for s, lp in zip(samples, lps, strict=True):
        assert lp.shape == s.rollout_logprobs.shape
        assert np.abs(lp - s.rollout_logprobs).max() < 1e-4


def test_r3_agreement_is_one_for_natural_rollout_routing(trainer, hf, model_dir):
    reload(trainer, model_dir)
    mbs = trainer.prepare(make_samples(hf, seed=2))
    metrics = trainer.old_policy_pass(mbs, trainer.cfg.replay.mode)
    assert metrics["routing_agreement"] > 0.99
    assert set(metrics["routing_agreement_by_layer"]) == {1, 2}  # model layers (0 is dense)
    assert metrics["logprob_diff_mean"] < 1e-4


def test_shifted_layer_map_is_caught(trainer, hf, model_dir):
    from trainer.replay import RoutingAgreementError
    from trainer.samples.alignment import LayerMap

    reload(trainer, model_dir)
    samples = make_samples(hf, seed=4)
    good, shifted = LayerMap.build((1, 2), ENGINE_LAYERS), LayerMap((0, 1), (1, 2))
    for s in samples:  # rebuild the engine view, then map it with a map off by one layer
        engine = np.zeros((s.routing_TLK.shape[0], 3, 2), np.int64)
        engine[:, 0] = s.routing_TLK[:, 0][:, ::-1]  # dense column: real-looking ids
        engine[:, list(good.columns)] = s.routing_TLK
        s.routing_TLK = shifted.select(engine)
    with pytest.raises(RoutingAgreementError, match=r"MoE layer \d \(HF layer \d\)"):
        trainer.old_policy_pass(trainer.prepare(samples), trainer.cfg.replay.mode)


def test_all_zero_routes_are_caught(trainer, hf, model_dir):
    from trainer.samples.alignment import InvalidRoutingError

    samples = make_samples(hf, seed=10)
    samples[1].routing_TLK[:, 1] = 0  # a capture hook that ran too early: zeros
    with pytest.raises(InvalidRoutingError, match=r"MoE layer 1 \(HF layer 2\)"):
        trainer.old_policy_pass(trainer.prepare(samples), ReplayMode.R3)


def test_shifted_row_offset_is_caught(trainer, hf, model_dir):
    from trainer.replay import RoutingAgreementError

    reload(trainer, model_dir)
    samples = make_samples(hf, seed=5)
    for s in samples:  # off by one row: row i carries row i+1's routing
        s.routing_TLK = np.concatenate([s.routing_TLK[1:], s.routing_TLK[-1:]])
    with pytest.raises(RoutingAgreementError, match="HF layer"):
        trainer.old_policy_pass(trainer.prepare(samples), trainer.cfg.replay.mode)


def test_r2_replays_old_policy_routing_after_weight_change(trainer, hf, model_dir):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

    reload(trainer, model_dir)
    mbs = trainer.prepare(make_samples(hf, seed=6))
    trainer.compute_logprobs(mbs, "r2")  # old policy: records its own routing per micro-batch
    recorded = [[t.sort(-1).values for t in mb.replay_rows] for mb in mbs]
    with torch.no_grad():
        for r in trainer.backend.policy.routers:
            r.weight.add_(torch.randn_like(r.weight) * 2.0)
    calls, handles = capture_routing(trainer)
    try:
        trainer.compute_logprobs(mbs, "off")
        natural = [c[2] for c in calls]
        calls.clear()
        # The router was moved far from the recorded routing on purpose: the update's
        # agreement floor would (rightly) stop this step; here only replay itself is tested.
        trainer.cfg.replay.check_agreement = False
        trainer.backend.update(mbs, ReplayMode.R2, _zero_loss)
    finally:
        trainer.cfg.replay.check_agreement = True
        for h in handles:
            h.remove()
    used = [c[2] for c in calls if c[0] == A.REPLAY_FORWARD]
    want = [t for mb_rec in recorded for t in mb_rec]
    assert len(used) == len(want) and all(torch.equal(u, w) for u, w in zip(used, want, strict=True))
    assert any(not torch.equal(n, w) for n, w in zip(natural, want, strict=True))  # weights moved routing
    reload(trainer, model_dir)


def _zero_loss(mb, logits):
    return logits.float().mean() * 0.0


def test_recompute_uses_each_microbatch_routing(model_dir, hf, trainer):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.samples.alignment import to_router_rows

    cfg = trainer.cfg.model_copy(deep=True)
    cfg.model.recompute_moe = True
    cfg.replay.check_agreement = False  # random routing: replay plumbing only, no agreement
    rec = make_trainer(TrainerConfig.model_validate(cfg.model_dump()))
    mbs = rec.prepare(make_samples(hf, n=4, routing="random", seed=7))
    assert len(mbs) == 2
    calls, handles = capture_routing(rec)
    try:
        rec.backend.update(mbs, ReplayMode.R3, _zero_loss)
    finally:
        for h in handles:
            h.remove()
    back = [c for c in calls if c[0] == A.REPLAY_BACKWARD]
    assert len(back) == 4  # 2 micro-batches x 2 MoE layers, recomputed in backward
    for mb_idx, mb in enumerate(mbs):
        rows = [r.sort(-1).values for r in to_router_rows(mb.routing_BSLK)]
        mine = back[2 * mb_idx:2 * mb_idx + 2]  # reverse layer order inside a micro-batch
        assert all(torch.equal(c[2], rows[c[1] - 2]) for c in mine)


def test_grpo_step_r3_with_reference(trainer, hf, model_dir):
    reload(trainer, model_dir)
    samples = make_samples(hf, n=6, seed=8, groups=2)
    first = trainer.train_step(samples)
    second = trainer.train_step(make_samples(hf, n=6, seed=8, groups=2))
    for k in ("grad_norm", "entropy", "loss", "ppo_kl", "kl_ref", "clip_ratio"):
        assert np.isfinite(first[k]) and np.isfinite(second[k]), k
    assert first["grad_norm"] > 0 and first["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert second["policy_version"] == first["policy_version"] + 1
    assert second["logprob_diff_mean"] > first["logprob_diff_mean"]  # weights moved off HF


def test_objectives_tis_mis_gspo_kl_in_reward_take_a_step(trainer, hf, model_dir):
    """trainer.losses.objectives' choices through the megatron backend: finite step, IS metrics."""
    reload(trainer, model_dir)
    saved = trainer.cfg.loss
    trainer.cfg.loss = saved.model_copy(update={
        "ratio_level": "sequence", "agg_mode": "seq-mean-token-mean", "kl_in": "reward",
        "kl_estimator": "k1", "rollout_correction": saved.rollout_correction.model_copy(
            update={"is_level": "sequence", "mask_level": "token"})})
    try:
        m = trainer.train_step(make_samples(hf, n=6, seed=8, groups=2))
    finally:
        trainer.cfg.loss = saved
    for k in ("grad_norm", "loss", "is_weight_mean", "mismatch_kl", "is_masked_share"):
        assert np.isfinite(m[k]), k
    assert m["grad_norm"] > 0 and sum(m["staleness_hist"].values()) == 6


def test_sft_step_lowers_loss(trainer, hf, model_dir):
    reload(trainer, model_dir)
    samples = make_samples(hf, n=4, seed=9)
    losses = [trainer.sft_step(samples)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]


def test_ppo_epochs_and_mini_batches_take_several_updates_per_step(trainer, hf, model_dir):
    reload(trainer, model_dir)
    optim, v0 = trainer.cfg.optim, trainer.policy_version
    optim.ppo_epochs, optim.mini_batches = 2, 2
    try:
        m = trainer.train_step(make_samples(hf, n=8, seed=10, groups=2))  # 4 micro-batches
    finally:
        optim.ppo_epochs, optim.mini_batches = 1, 1
    assert m["updates"] == 4 and m["policy_version"] == v0 + 1  # one version per step
    assert m["ppo_kl"] != 0.0 and np.isfinite(m["ppo_kl"])  # later updates see a moved policy
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


# ---------------------------------------------------------------- detector (issue 19 item 8)
def segmented(samples, seg1_len=3):
    """Name the samples and split each response into two segments (the last `seg1_len`
    tokens form segment 1, as after a partial-rollout resume)."""
    for i, s in enumerate(samples):
        r = s.tokens.size - s.prompt_len
        s.trajectory_id, s.segment_lens = f"t{i}", (r - seg1_len, seg1_len)
    return samples


def shift_segment1(s) -> None:
    """Segment 1's rows off by one (row i carries row i+1's routing); other rows untouched."""
    r = s.tokens.size - s.prompt_len
    a, e = s.prompt_len - 1 + s.segment_lens[0], s.prompt_len - 1 + r  # e = P+R-1 rows
    rows = s.routing_TLK.copy()
    rows[a:e - 1] = s.routing_TLK[a + 1:e]
    s.routing_TLK = rows


def test_shifted_rows_of_one_segment_of_one_trajectory_are_caught(trainer, hf, model_dir):
    from trainer.replay import RoutingAgreementError

    reload(trainer, model_dir)
    samples = segmented(make_samples(hf, n=4, seed=11))
    shift_segment1(samples[2])
    with pytest.raises(RoutingAgreementError, match="at trajectory t2 segment 1 \\(group g0\\)") \
            as err:
        trainer.old_policy_pass(trainer.prepare(samples), ReplayMode.R3)
    assert set(err.value.bad_groups) == {"g0"}  # the group to quarantine, and only it


def _bypass_replay(monkeypatch):
    """Replay silently ignored inside the model: the router routes by its own top-k."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    def natural(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        return default_compute_topk(scores, topk, num_groups, group_topk)
    monkeypatch.setattr(RouterReplay, "get_replay_topk", natural)


def test_replay_bypassed_inside_the_model_is_caught_r3(trainer, hf, model_dir, monkeypatch):
    from trainer.replay import ReplayDesyncError

    reload(trainer, model_dir)
    mbs = trainer.prepare(make_samples(hf, n=2, routing="random", seed=12))
    _bypass_replay(monkeypatch)
    with pytest.raises(ReplayDesyncError, match=r"HF layer \d\): the router used experts other"):
        trainer.old_policy_pass(mbs, ReplayMode.R3)


def test_replay_bypassed_inside_the_model_is_caught_r2(trainer, hf, model_dir, monkeypatch):
    from trainer.replay import ReplayDesyncError

    reload(trainer, model_dir)
    mbs = trainer.prepare(make_samples(hf, n=2, seed=13))
    trainer.compute_logprobs(mbs, "r2")  # records the routing of these weights
    with torch.no_grad():
        for r in trainer.backend.policy.routers:
            r.weight.add_(torch.randn_like(r.weight) * 2.0)  # natural routing moves away
    _bypass_replay(monkeypatch)
    try:
        with pytest.raises(ReplayDesyncError, match="replay bypassed or out of step"):
            trainer.backend.update(mbs, ReplayMode.R2, _zero_loss)
    finally:
        reload(trainer, model_dir)


def test_a_group_with_one_shifted_segment_is_quarantined_and_the_step_goes_on(
        trainer, hf, model_dir):
    reload(trainer, model_dir)
    samples = segmented(make_samples(hf, n=4, seed=11))
    shift_segment1(samples[2])  # group g0
    m = trainer.train_step(samples)
    assert m["dropped"] == {"g0": "routing_agreement"}
    assert m["trajectories"] == 2 and np.isfinite(m["grad_norm"])  # g1 trained
    # the step's worst cell is the faulting pass's (issue 43); the trained batch reads healthy
    assert m["routing_agreement_min"] < 0.9 < m["routing_agreement"]
    assert "trajectory t2 segment 1 (group g0)" in m["routing_agreement_worst"]
    assert (m["updates_skipped"], m["updates_rerun"]) == (1, 1)
    reload(trainer, model_dir)


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_int64_replay_rows_alive_do_not_grow_with_micro_batches(trainer, hf, model_dir, mode):
    """Issue 54: a pass widens one micro-batch's ids to int64 at a time (the rest stay in the
    codec's dtype), so the int64 rows alive at any router forward are at most one micro-batch's,
    with 2 micro-batches as with 4 (a pass that kept every micro-batch's rows held 4x)."""
    reload(trainer, model_dir)
    b, samples = trainer.backend, make_samples(hf, n=8, seed=11)
    for n in (4, 8):
        mbs = trainer.prepare(samples[:n])
        assert len(mbs) == n // 2
        one_mb = max(mb.tokens_BS.numel() for mb in mbs) * len(b.policy.moe_layers) * b.top_k * 8
        with RowsAlive(b.policy.routers, lambda r: [r.router_replay.target_topk_idx]) as rows:
            trainer.compute_logprobs(mbs, mode)  # r2: records the policy's own routing
            b.update(mbs, ReplayMode(mode), _zero_loss)
        assert rows.seen == len(mbs) * len(b.policy.moe_layers) * (2 if mode == "r3" else 1)
        assert 0 < rows.peak <= one_mb, (n, rows.peak, one_mb)
