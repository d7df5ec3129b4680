"""Trajectory protos -> samples (routing decoded, assembled, layer-mapped) -> micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.samples.alignment import LayerMap, to_router_rows
from trainer.samples.batch import (
    make_microbatch,
    routed_ids,
    sample_from_trajectory,
    split_microbatches,
    update_schedule,
)


def _traj(seed=0, segments=(4, 3), prompt=8):
    from services.store.synthetic import build_trajectory

    rng = np.random.default_rng(seed)
    rows = prompt + sum(segments) - 1
    ids = np.stack([rng.permutation(8)[:2] for _ in range(rows * 3)]).reshape(rows, 3, 2)
    t = build_trajectory("t0", "g0", 1, prompt_ids_TLK=ids[:prompt].astype(np.uint8),
                         response_ids_TLK=ids[prompt:].astype(np.uint8),
                         segment_lengths=list(segments), num_experts=8, seed=seed)
    return t, ids


def test_partial_rollout_segments_assemble_to_all_rows_and_map_layers():
    traj, ids = _traj()
    s = sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=8)
    assert s.tokens.size == 15 and s.prompt_len == 8 and s.rollout_logprobs.size == 7
    assert s.routing_TLK.shape == (14, 2, 2)
    assert np.array_equal(np.sort(s.routing_TLK, -1), np.sort(ids[:, 1:], -1))


def test_duplicated_segment_prefix_is_rejected():
    traj, _ = _traj()
    seg1 = traj.segments[1]
    dup = type(seg1.routing[0])()
    dup.CopyFrom(traj.segments[0].routing[-1])
    seg1.routing.insert(0, dup)  # a resumed request that re-sent the earlier segment's rows
    with pytest.raises(ValueError, match="duplicated"):
        sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=8)


def test_microbatch_labels_mask_and_logprobs_line_up():
    traj, _ = _traj()
    s = sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=8)
    s.loss_mask[2] = False  # an environment token
    mb = make_microbatch([s], pad_multiple=8)
    assert mb.tokens_BS.shape == (1, 16)
    resp = mb.loss_mask_BS[0].nonzero()[:, 0].tolist()
    assert resp == [7, 8, 10, 11, 12, 13]  # positions P-1 .. P+R-2, minus the masked token
    assert torch.equal(mb.labels_BS[0, 7:14], torch.from_numpy(s.tokens[8:15]))
    assert mb.old_logprobs_BS[0, 7] == pytest.approx(float(s.rollout_logprobs[0]))
    assert mb.valid_rows_BS[0].sum() == 14 and mb.routing_BSLK.shape == (1, 16, 2, 2)
    assert mb.num_tokens == 6


def test_split_sorts_by_length():
    samples = []
    for seed, segs in enumerate([(4, 3), (2, 1), (6, 5)]):
        traj, _ = _traj(seed, segs)
        samples.append(sample_from_trajectory(traj, None, num_experts=8))
    mbs = split_microbatches(samples, 2, pad_multiple=4)
    assert [mb.tokens_BS.shape for mb in mbs] == [(2, 16), (1, 20)]
    assert all(mb.routing_BSLK is None for mb in mbs)


def test_update_schedule_deals_microbatches_round_robin_per_epoch():
    mbs = list(range(5))  # stands for 5 length-sorted micro-batches
    assert update_schedule(mbs) == [[0, 1, 2, 3, 4]]
    assert update_schedule(mbs, epochs=2, mini_batches=2) == [[0, 2, 4], [1, 3]] * 2
    assert update_schedule(mbs[:2], mini_batches=4) == [[0], [1]]  # never an empty update


@pytest.mark.parametrize("num_experts, top_k", [(16, 2), (8, 3)])
def test_routing_of_another_expert_count_or_top_k_is_refused(num_experts, top_k):
    from trainer.samples.alignment import RoutingLayoutError

    traj, _ = _traj()  # 8 experts, top-2
    with pytest.raises(RoutingLayoutError, match=f"num_experts={num_experts}, top_k={top_k}"):
        sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=num_experts,
                               top_k=top_k)
    sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=8, top_k=2)


def test_segment_temperature_reaches_the_microbatch_and_truncation_is_refused():
    from trainer.samples.batch import UnreproducibleSamplingError

    traj, _ = _traj(segments=(4, 3))
    traj.segments[0].sampling.temperature, traj.segments[0].sampling.top_p = 0.6, 1.0
    traj.segments[1].sampling.temperature, traj.segments[1].sampling.top_p = 0.8, 1.0
    s = sample_from_trajectory(traj, None, num_experts=8)
    assert np.allclose(s.temperature, [0.6] * 4 + [0.8] * 3)
    mb = make_microbatch([s])
    assert np.allclose(mb.temperature_BS[0, 7:14].numpy(), s.temperature)  # predict the response
    assert float(mb.temperature_BS[0, :7].sum()) == 7.0  # 1 where nothing is sampled
    for field, value, match in (("top_p", 0.9, "top_p=0.9"), ("top_k", 20, "top_k=20"),
                                ("temperature", 0.0, "greedy")):
        bad, _ = _traj()
        bad.segments[1].sampling.temperature, bad.segments[1].sampling.top_p = 1.0, 1.0
        setattr(bad.segments[1].sampling, field, value)
        with pytest.raises(UnreproducibleSamplingError, match=f"segment 1 sampling.*{match}"):
            sample_from_trajectory(bad, None, num_experts=8)


def test_host_routing_stays_in_the_codec_dtype_until_the_device():
    """Issue 54: a sample and its micro-batch hold routing as the codec's uint8 (1/8 of int64),
    on the host and on the device; routed_ids widens one micro-batch to the int64 the routing
    rules and routers take, values unchanged."""
    traj, ids = _traj()
    s = sample_from_trajectory(traj, LayerMap.build((1, 2), (0, 1, 2)), num_experts=8)
    assert s.routing_TLK.dtype == np.uint8
    mb = make_microbatch([s], pad_multiple=8).to(torch.device("cpu"))
    assert mb.routing_BSLK.dtype == torch.uint8
    wide = routed_ids(mb.routing_BSLK)
    assert wide.dtype == torch.int64 and torch.equal(wide.to(torch.uint8), mb.routing_BSLK)
    assert np.array_equal(np.sort(wide[0, :14].numpy(), -1), np.sort(ids[:, 1:], -1))
    assert to_router_rows(mb.routing_BSLK)[0].dtype == torch.int64


def test_routing_left_encoded_at_intake_gives_the_same_microbatches_and_pickles():
    """Issue 54: `keep_encoded` checks the routing at intake (a bad chunk still fails there),
    keeps the chunk messages instead of the decoded array, and the micro-batches (padded and
    packed) decode the same ids; the sample pickles as the messages (Megatron's model-parallel
    exchange) and decodes the same afterwards."""
    import pickle

    from trainer.hf.packing import pack_microbatches

    lmap = LayerMap.build((1, 2), (0, 1, 2))
    trajs = [_traj(seed)[0] for seed in (0, 1, 2)]
    decoded = [sample_from_trajectory(t, lmap, num_experts=8) for t in trajs]
    encoded = [sample_from_trajectory(t, lmap, num_experts=8, keep_encoded=True) for t in trajs]
    assert all(s.routing_TLK is None and s.has_routing for s in encoded)
    for a, b in zip(decoded, encoded, strict=True):
        assert np.array_equal(a.routing_TLK, b.routing())
    for cut in (split_microbatches, pack_microbatches):
        for ma, mb in zip(cut(decoded, 2, 8), cut(encoded, 2, 8), strict=True):
            assert torch.equal(ma.routing_BSLK, mb.routing_BSLK)
    back = pickle.loads(pickle.dumps(encoded[1]))
    assert back.routing_TLK is None and np.array_equal(back.routing(), decoded[1].routing_TLK)
    bad, _ = _traj(3)
    bad.segments[1].routing[0].num_experts = 16  # another model's routing: refused at intake
    with pytest.raises(ValueError, match="num_experts=16"):
        sample_from_trajectory(bad, lmap, num_experts=8, keep_encoded=True)


def test_layer_map_of_every_column_in_order_does_not_copy():
    ids_TLK = np.zeros((4, 3, 2), np.uint8)
    assert LayerMap.build((0, 1, 2), (0, 1, 2)).select(ids_TLK) is ids_TLK
    assert LayerMap.build((2, 0), (0, 1, 2)).select(ids_TLK).shape == (4, 2, 2)


def test_packed_and_padded_microbatches_move_to_the_device_as_built():
    """Both cuts take the device: each micro-batch arrives there with its uint8 routing; the
    packed one holds both samples back to back."""
    from trainer.hf.packing import pack_microbatches

    lmap = LayerMap.build((1, 2), (0, 1, 2))
    samples = [sample_from_trajectory(_traj(seed)[0], lmap, num_experts=8) for seed in (0, 1)]
    host = pack_microbatches(samples, 2, 8)[0].routing_BSLK
    assert host.dtype == torch.uint8 and host.shape == (1, 32, 2, 2)
    packed = pack_microbatches(samples, 2, 8, torch.device("cpu"))[0].routing_BSLK
    assert torch.equal(packed, host)
    assert torch.equal(packed[0, 15:29], torch.from_numpy(samples[1].routing_TLK))
    padded = split_microbatches(samples, 1, 8, torch.device("cpu"))
    assert [mb.routing_BSLK.shape for mb in padded] == [(1, 16, 2, 2)] * 2


def test_128k_trajectory_spliced_across_a_weight_update_pause_assembles_exactly():
    """Issue 54: a 131,072-token trajectory (16k prompt, three segments, the weight update
    between segments 1 and 2) reassembles its routing row for row from the segments' chunks,
    in uint8, every segment's rows where the wire convention puts them."""
    from services.store.synthetic import build_trajectory

    prompt, segments = 16_384, (50_000, 30_000, 34_688)
    rows = prompt + sum(segments) - 1
    keys = np.random.default_rng(0).random((rows, 8))
    ids = np.argsort(keys, axis=1)[:, :2].astype(np.uint8).reshape(rows, 1, 2)
    traj = build_trajectory("long", "g", 1, prompt_ids_TLK=ids[:prompt],
                            response_ids_TLK=ids[prompt:], segment_lengths=list(segments),
                            num_experts=8, policy_versions=[3, 3, 4])
    s = sample_from_trajectory(traj, LayerMap.build((0,), (0,)), num_experts=8)
    assert s.tokens.size == 131_072 and s.routing_TLK.dtype == np.uint8
    assert np.array_equal(np.sort(s.routing_TLK, -1), np.sort(ids, -1))
    assert s.policy_version == 3 and s.segment_lens == segments
    assert [u[1:] for u in s.agreement_units()] == [
        (0, 16_383), (16_383, 66_383), (66_383, 96_383), (96_383, 131_071)]
