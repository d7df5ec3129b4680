"""Wire-format splicing used by the store: split/join of the prompt chunk, PulledGroup bytes."""

from __future__ import annotations

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store import wirefmt
from services.store.assemble import Delivery
from services.store.synthetic import small_group


def test_varint_matches_protobuf() -> None:
    for n in (1, 127, 128, 300, 2**21, 2**31 + 7):  # 0 is not serialized (proto3 default)
        msg = store_pb2.PulledGroup(delivery_count=n)
        assert msg.SerializeToString() == b"\x20" + wirefmt.varint(n)


def test_prompt_chunk_split_and_join_round_trip() -> None:
    seg = small_group("g", 1)[0].segments[0]
    assert len(seg.routing) == 2
    payload, head_len = wirefmt.split_prompt_segment(seg)
    rest = trajectory_pb2.Segment.FromString(payload)
    assert [c.start_row for c in rest.routing] == [8] and list(rest.token_ids) == list(seg.token_ids)
    prompt = seg.routing[0].SerializeToString(deterministic=True)
    back = trajectory_pb2.Segment.FromString(wirefmt.join_prompt_segment(payload, prompt, head_len))
    assert back == seg


def test_delivery_bytes_parse_as_pulled_group() -> None:
    trajs = small_group("g", 2)
    d = Delivery("1-0", "g", 3, 0, [t.SerializeToString() for t in trajs])
    msg = store_pb2.PulledGroup.FromString(d.to_bytes())
    assert (msg.delivery_id, msg.group_id, msg.delivery_count) == ("1-0", "g", 3)
    assert list(msg.trajectories) == trajs


def test_prompt_chunk_split_keeps_the_sampling_params() -> None:
    seg = small_group("g", 1)[0].segments[0]
    seg.sampling.temperature, seg.sampling.top_p = 0.6, 1.0
    payload, head_len = wirefmt.split_prompt_segment(seg)
    prompt = seg.routing[0].SerializeToString(deterministic=True)
    back = trajectory_pb2.Segment.FromString(wirefmt.join_prompt_segment(payload, prompt, head_len))
    assert back == seg and back.sampling.temperature == seg.sampling.temperature
