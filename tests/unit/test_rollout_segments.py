"""Segment/row bookkeeping of partial rollouts and multi-turn trajectories (no engine).

Legend: T = routing rows, L = layers, K = top-k.
"""

import numpy as np
import pytest

from services.rollout.segments import (
    CallOutput,
    RolloutState,
    RoutingCheckError,
    check_routing,
    segment_row_ranges,
    split_rows,
)

L, K, E = 3, 2, 8


def rows(start: int, end: int) -> np.ndarray:
    """Rows whose ids encode their own row index, so slices can be traced back."""
    ids_TLK = np.zeros((end - start, L, K), dtype=np.int64)
    ids_TLK[:, :, 0] = np.arange(start, end)[:, None]
    ids_TLK[:, :, 1] = -1
    return ids_TLK


def call(tokens, routing, reason="stop", version=0, rid="r"):  # noqa: ANN001
    return CallOutput(list(tokens), [-0.5] * len(tokens), routing, reason, version, rid)


def test_row_ranges_follow_wire_convention():
    assert segment_row_ranges(5, [3]) == [(0, 7)]
    assert segment_row_ranges(5, [3, 4, 1]) == [(0, 7), (7, 11), (11, 12)]
    with pytest.raises(ValueError, match="prompt_len"):
        segment_row_ranges(0, [1])


def test_split_rows_checks_count_and_slices():
    full = rows(0, 5 + 3 + 2 - 1)
    parts = split_rows(full, 5, [3, 2])
    assert [p.shape[0] for p in parts] == [7, 2]
    assert np.array_equal(np.concatenate(parts), full)
    with pytest.raises(ValueError, match="routing rows"):
        split_rows(full[:-1], 5, [3, 2])


def test_segment_policy_partial_rollout_keeps_each_segments_rows():
    st = RolloutState(list(range(5)))
    assert st.request_start_row() == 0
    # call 0: aborted after 3 tokens: rows [0, 5+3-1)
    st.close_call(call([10, 11, 12], rows(0, 7), "abort", version=0))
    assert st.known_rows() == 7 and st.request_start_row() == 7
    assert st.context_ids() == list(range(5)) + [10, 11, 12]
    # call 1 resumes with prompt+generated and asks only for rows from 7 on
    st.close_call(call([13, 14], rows(7, 9), "length", version=1))
    assert [s.policy_version for s in st.segments] == [0, 1]
    all_rows = st.all_rows()
    assert all_rows.shape[0] == 5 + 5 - 1
    assert np.array_equal(all_rows[:, 0, 0], np.arange(9))  # no duplicated or dropped row


def test_replace_policy_takes_last_calls_full_routing():
    st = RolloutState(list(range(5)), policy="replace")
    st.close_call(call([10, 11, 12], rows(0, 7), "abort"))
    assert st.request_start_row() == 0
    new_full = rows(100, 109)  # the resumed call returns every row again
    st.close_call(call([13, 14], new_full, "stop", version=1))
    assert np.array_equal(st.all_rows(), new_full)
    assert st.segments[0].rows_TLK.shape[0] == 7 and st.segments[1].rows_TLK.shape[0] == 2


def test_call_without_tokens_adds_no_segment():
    st = RolloutState([1, 2, 3])
    assert st.close_call(call([], None, "abort")) is None
    assert st.segments == [] and st.request_start_row() == 0


def test_multi_turn_env_tokens_are_masked_and_take_next_prefill_rows():
    st = RolloutState(list(range(4)))
    st.close_call(call([20, 21], rows(0, 5), "stop"))
    st.add_env_tokens([30, 31, 32])
    assert st.context_ids() == list(range(4)) + [20, 21, 30, 31, 32]
    assert st.request_start_row() == 5
    # next turn's prefill returns rows [5, 9) for the last token + 3 env tokens, then 1 decode row
    seg = st.close_call(call([40, 41], rows(5, 10), "stop", version=2))
    assert seg.token_ids == [30, 31, 32, 40, 41]
    assert seg.loss_mask == [0, 0, 0, 1, 1]
    assert seg.logprobs[:3] == [0.0, 0.0, 0.0]
    assert st.all_rows().shape[0] == 4 + 7 - 1
    assert np.array_equal(st.all_rows()[:, 0, 0], np.arange(10))


def test_env_tokens_before_first_turn_rejected():
    with pytest.raises(ValueError, match="environment tokens"):
        RolloutState([1]).add_env_tokens([2])


def test_wrong_row_count_from_engine_names_request():
    st = RolloutState(list(range(5)))
    with pytest.raises(RoutingCheckError, match="request req-9"):
        st.close_call(call([1, 2], rows(0, 7), "stop", rid="req-9"))


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="empty prompt"):
        RolloutState([])


def good_routing(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    ids_TLK = np.zeros((n, L, K), dtype=np.uint8)  # layer 0 dense: zeros, as vLLM reports
    for layer in (1, 2):
        ids_TLK[:, layer] = np.stack([rng.choice(E, K, replace=False) for _ in range(n)])
    return ids_TLK


def test_check_routing_accepts_good_and_ignores_dense_layers():
    check_routing(good_routing(9), num_experts=E, moe_layers=[1, 2], expected_rows=9,
                  request_id="ok")


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r[:-1], "8 routing rows, expected"),
    (lambda r: _set(r, (3, 1, 0), E), "expert id 8 >= num_experts"),
    (lambda r: _set(r, (4, 2, 1), r[4, 2, 0]), "repeated expert id in row 4, layer 2"),
])
def test_check_routing_failures_name_the_request(mutate, match):  # noqa: ANN001
    with pytest.raises(RoutingCheckError, match=f"request abc: {match}"):
        check_routing(mutate(good_routing(9)), num_experts=E, moe_layers=[1, 2],
                      expected_rows=9, request_id="abc")


def test_check_routing_top1_all_on_expert_zero_is_legitimate():
    ids_TLK = np.zeros((6, 2, 1), dtype=np.uint8)  # top-1: every token of layer 0 on expert 0
    ids_TLK[:, 1, 0] = 3
    check_routing(ids_TLK, num_experts=4, moe_layers=[0, 1], expected_rows=6, request_id="z")


def test_check_routing_all_zero_rows_of_topk2_are_rejected():
    ids_TLK = good_routing(9)
    ids_TLK[5, 2] = 0  # one all-zero row: a capture hook that ran too early
    with pytest.raises(RoutingCheckError, match="request z: all-zero row .* in row 5, layer 2"):
        check_routing(ids_TLK, num_experts=E, moe_layers=[1, 2], expected_rows=9,
                      request_id="z")


def _set(a: np.ndarray, idx, value):  # noqa: ANN001
    a = a.copy()
    a[idx] = value
    return a


def test_check_routing_dense_layer_must_be_zero():
    ids_TLK = good_routing(9)
    ids_TLK[2, 0] = [1, 2]
    with pytest.raises(RoutingCheckError, match="dense layer 0 has routed experts"):
        check_routing(ids_TLK, num_experts=E, moe_layers=[1, 2], expected_rows=9,
                      request_id="d", dense_layers=(0,))
