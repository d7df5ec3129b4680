"""Validation rules of the trajectory store: each bad message -> ValueError naming the field."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

from services.common.pb.r3flow.v1 import routing_pb2, store_pb2, trajectory_pb2
from services.common.wire import routing_to_proto
from services.store import validate
from services.store.parts import trajectory_requests
from services.store.synthetic import random_routing, small_group
from services.store.validate import GroupState, Limits, TrajState

LIMITS = Limits(max_tokens_per_trajectory=64, max_group_size=16)


def _requests() -> list[store_pb2.AppendRequest]:
    """begin, segment 0 (P=8, n0=4: prompt chunk + 3 rows), segment 1 (n1=3), finish."""
    return trajectory_requests(small_group("g", 2, seed=1)[0])


def _state_after(reqs: list[store_pb2.AppendRequest]) -> TrajState:
    """Run the valid messages through validation, as the store does within one stream."""
    state = TrajState()
    for req in reqs:
        kind = validate.check_envelope(req)
        assert validate.check_order(req, state)
        if kind == "begin":
            write = validate.validate_begin(req, GroupState(), LIMITS)
        elif kind == "segment":
            write = validate.validate_segment(req, state, LIMITS)
        else:
            write = validate.validate_finish(req, state)
        validate.advance(state, write)
    return state


def _segment_error(seq: int, mutate) -> str:  # noqa: ANN001
    reqs = _requests()
    state = _state_after(reqs[:seq])
    req = reqs[seq]
    mutate(req.segment)
    with pytest.raises(ValueError) as err:
        validate.validate_segment(req, state, LIMITS)
    return str(err.value)


def test_valid_trajectory_passes_and_tracks_rows() -> None:
    reqs = _requests()
    state = _state_after(reqs)
    assert state.done and state.num_segments == 2
    assert state.rows == 8 + 4 + 3 - 1  # P + R - 1
    assert state.tokens == 8 + 4 + 3


def test_prompt_chunk_is_split_off_for_dedup() -> None:
    reqs = _requests()
    write = validate.validate_segment(reqs[1], _state_after(reqs[:1]), LIMITS)
    assert write.prompt_field.startswith("p:") and write.prompt_chunk
    stored = trajectory_pb2.Segment.FromString(write.payload)
    assert len(stored.routing) == 1 and stored.routing[0].start_row == 8


@pytest.mark.parametrize("mutate, field", [
    (lambda r: setattr(r, "trajectory_id", ""), "trajectory_id"),
    (lambda r: r.ClearField("begin"), "body"),
    (lambda r: setattr(r, "sequence_number", 2), "sequence_number"),
])
def test_envelope_rules(mutate, field: str) -> None:  # noqa: ANN001
    req = _requests()[0]
    mutate(req)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        validate.check_envelope(req)


def test_sequence_gap_names_sequence_number_and_duplicates_are_not_errors() -> None:
    reqs = _requests()
    state = _state_after(reqs[:1])
    with pytest.raises(ValueError, match=r"^sequence_number: got 2, expected 1"):
        validate.check_order(reqs[2], state)
    assert validate.check_order(reqs[0], state) is False  # retried begin: a no-op


@pytest.mark.parametrize("mutate, group, field", [
    (lambda b: setattr(b, "group_size", 0), GroupState(), "begin.group_size"),
    (lambda b: setattr(b, "group_size", 17), GroupState(), "begin.group_size"),
    (lambda b: None, GroupState(size=4, members=1), "begin.group_size"),
    (lambda b: None, GroupState(size=2, members=2), "begin.group_id"),
    (lambda b: None, GroupState(closed=True), "begin.group_id"),
    (lambda b: setattr(b, "group_id", ""), GroupState(), "begin.group_id"),
    (lambda b: b.ClearField("prompt_token_ids"), GroupState(), "begin.prompt_token_ids"),
    (lambda b: b.prompt_token_ids.extend([1] * 64), GroupState(), "begin.prompt_token_ids"),
    (lambda b: b.prompt_token_ids.append(-3), GroupState(), "begin.prompt_token_ids"),
])
def test_begin_rules(mutate, group: GroupState, field: str) -> None:  # noqa: ANN001
    req = _requests()[0]
    mutate(req.begin)
    with pytest.raises(ValueError, match=rf"^{field}:"):
        validate.validate_begin(req, group, LIMITS)


def _set_checksum(chunk: routing_pb2.RoutedExperts) -> None:
    chunk.checksum = zlib.crc32(chunk.data)


def _relayout(layers: int, topk: int, num_experts: int, layer_ids=None):  # noqa: ANN001, ANN202
    def mutate(seg: trajectory_pb2.Segment) -> None:
        rng = np.random.default_rng(0)
        ids = random_routing(3, layers, topk, num_experts, rng)
        chunk = routing_to_proto(ids, num_experts, start_row=11,
                                 layer_ids=layer_ids or list(range(layers)))
        seg.routing[0].CopyFrom(chunk)
    return mutate


@pytest.mark.parametrize("seq, mutate, field", [
    (2, lambda s: setattr(s, "index", 0), "segment.index"),
    (2, lambda s: (s.ClearField("token_ids"), s.ClearField("logprobs"),
                   setattr(s, "loss_mask", b"")), "segment.token_ids"),
    (2, lambda s: s.token_ids.__setitem__(0, -1), "segment.token_ids"),
    (2, lambda s: s.logprobs.append(-0.5), "segment.logprobs"),
    (2, lambda s: s.logprobs.__setitem__(0, float("nan")), "segment.logprobs"),
    (2, lambda s: setattr(s, "loss_mask", b"\x01"), "segment.loss_mask"),
    (2, lambda s: setattr(s, "loss_mask", b"\x01\x02\x01"), "segment.loss_mask"),
    (2, lambda s: setattr(s, "policy_version", -1), "segment.policy_version"),
    (2, lambda s: s.ClearField("routing"), "segment.routing"),
    (2, lambda s: setattr(s.routing[0], "start_row", 12), r"segment.routing\[0\].start_row"),
    (1, lambda s: setattr(s.routing[1], "start_row", 7), r"segment.routing\[1\].start_row"),
    (2, lambda s: setattr(s.routing[0], "checksum", s.routing[0].checksum ^ 1),
     r"segment.routing\[0\].checksum"),
    (2, lambda s: setattr(s.routing[0], "codec", 0), r"segment.routing\[0\].codec"),
    (2, lambda s: s.routing[0].shape.__setitem__(0, 4), r"segment.routing\[0\].shape"),
    (2, lambda s: setattr(s.routing[0], "num_experts", 9), r"segment.routing\[0\].num_experts"),
    (2, lambda s: s.routing[0].layer_ids.append(5), r"segment.routing\[0\].layer_ids"),
    (2, lambda s: (setattr(s.routing[0], "data", b"\x00garbage" + s.routing[0].data[8:]),
                   _set_checksum(s.routing[0])), r"segment.routing\[0\].(data|shape)"),
    # Later segments must keep the trajectory's layout.
    (2, _relayout(3, 2, 8), r"segment.routing\[0\].shape\[1\]"),
    (2, _relayout(2, 3, 8), r"segment.routing\[0\].shape\[2\]"),
    (2, _relayout(2, 2, 16), r"segment.routing\[0\].num_experts"),
    (2, _relayout(2, 2, 8, [4, 5]), r"segment.routing\[0\].layer_ids"),
])
def test_segment_rules(seq: int, mutate, field: str) -> None:  # noqa: ANN001
    message = _segment_error(seq, mutate)
    assert re.match(field, message), message


def test_row_count_follows_prompt_plus_response_minus_one() -> None:
    """Sending P + n0 rows for segment 0 (the off-by-one) is rejected with the convention."""
    reqs = _requests()
    state = _state_after(reqs[:1])
    seg = reqs[1].segment
    rng = np.random.default_rng(2)
    extra = routing_to_proto(random_routing(4, 2, 2, 8, rng), 8, start_row=8, layer_ids=[0, 1])
    seg.routing[1].CopyFrom(extra)  # rows [8, 12) instead of [8, 11)
    with pytest.raises(ValueError, match=r"^segment.routing: 12 rows, expected 11 .*P\+R-1"):
        validate.validate_segment(reqs[1], state, LIMITS)


def test_token_limit_counts_the_whole_trajectory() -> None:
    reqs = _requests()
    state = _state_after(reqs[:2])
    tight = Limits(max_tokens_per_trajectory=14, max_group_size=16)  # trajectory has 15
    with pytest.raises(ValueError, match=r"^segment.token_ids: .*max_tokens_per_trajectory=14"):
        validate.validate_segment(reqs[2], state, tight)


@pytest.mark.parametrize("mutate, field", [
    (lambda f: setattr(f, "num_segments", 3), "finish.num_segments"),
    (lambda f: setattr(f, "reward", float("inf")), "finish.reward"),
    (lambda f: f.reward_components.__setitem__("x", float("nan")), "finish.reward_components"),
    (lambda f: setattr(f, "finish_reason", 42), "finish.finish_reason"),
])
def test_finish_rules(mutate, field: str) -> None:  # noqa: ANN001
    reqs = _requests()
    state = _state_after(reqs[:3])
    mutate(reqs[3].finish)
    with pytest.raises(ValueError, match=rf"^{field}"):
        validate.validate_finish(reqs[3], state)


def test_layout_round_trips_through_its_redis_encoding() -> None:
    layout = validate.Layout(48, 8, 128, tuple(range(1, 49)))
    assert validate.Layout.decode(layout.encode()) == layout


HEADER_ONLY = Limits(max_tokens_per_trajectory=64, max_group_size=16, decode_routing=False)


@pytest.mark.parametrize("mutate, field", [
    (lambda s: setattr(s.routing[0], "checksum", s.routing[0].checksum ^ 1),
     "segment.routing[0].checksum"),
    (lambda s: s.routing[0].shape.__setitem__(2, 1), "segment.routing[0].shape"),
    (lambda s: setattr(s.routing[0], "num_experts", 9), "segment.routing[0].num_experts"),
    (lambda s: (setattr(s.routing[0], "data", b"junk"), _set_checksum(s.routing[0])),
     "segment.routing[0].data"),
])
def test_header_only_validation_still_checks_envelope_of_chunks(mutate, field: str) -> None:  # noqa: ANN001
    reqs = _requests()
    state = _state_after(reqs[:2])
    mutate(reqs[2].segment)
    with pytest.raises(ValueError) as err:
        validate.validate_segment(reqs[2], state, HEADER_ONLY)
    assert str(err.value).startswith(field), err.value


def test_header_only_validation_does_not_decode_payloads() -> None:
    """The documented trade-off: a corrupted payload with a fresh CRC passes header checks."""
    reqs = _requests()
    state = _state_after(reqs[:2])
    chunk = reqs[2].segment.routing[0]
    chunk.data = chunk.data[:32] + bytes(len(chunk.data) - 32)
    _set_checksum(chunk)
    write = validate.validate_segment(reqs[2], state, HEADER_ONLY)
    assert write.rows == 3
    with pytest.raises(ValueError, match=r"^segment.routing\[0\].data"):
        validate.validate_segment(reqs[2], state, LIMITS)


def test_routing_of_an_unregistered_layout_is_refused() -> None:
    reqs = _requests()  # 8 experts, top-2
    state = _state_after(reqs[:1])
    other = Limits(max_tokens_per_trajectory=64, max_group_size=16,
                   models=(("qwen3-30b-a3b", 128, 8), ("tiny-k3", 8, 3)))
    with pytest.raises(ValueError, match=r"^segment.routing\[0\].num_experts/shape\[2\]: routing "
                       r"has num_experts=8, top_k=2; registered models: qwen3-30b-a3b"):
        validate.validate_segment(reqs[1], state, other)
    same = Limits(max_tokens_per_trajectory=64, max_group_size=16,
                  models=(("tiny-k3", 8, 3), ("tiny", 8, 2)))
    validate.validate_segment(reqs[1], state, same)
