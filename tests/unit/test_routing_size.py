"""The worst-case sizes the plan and the chart size for (services/common/routing_size.py) hold
for what the codec and the wire really produce on uniform routing, the codec's worst input."""

from __future__ import annotations

import numpy as np
import pytest

from services.common import routing, routing_size
from services.common.pb.r3flow.v1 import trajectory_pb2
from services.common.wire import routing_to_proto
from services.store.parts import trajectory_requests


def uniform(tokens: int, layers: int, topk: int, experts: int, seed: int = 0) -> np.ndarray:
    """Uniformly drawn distinct top-k ids per row (the codec's worst case)."""
    keys = np.random.default_rng(seed).random((tokens, layers, experts), dtype=np.float32)
    return np.argsort(keys, axis=-1)[..., :topk].astype(np.int32)


@pytest.mark.parametrize(("tokens", "layers", "topk", "experts"), [
    (1, 48, 8, 128), (63, 48, 8, 128), (2048, 48, 8, 128), (70_000, 2, 8, 128),
    (8192, 8, 4, 128), (4096, 4, 8, 256), (2000, 2, 16, 1024), (1000, 3, 2, 8)])
@pytest.mark.parametrize("mode", ["canonical", "exact"])
def test_blob_bound_holds_on_uniform_routing(tokens, layers, topk, experts, mode):
    ids = uniform(tokens, layers, topk, experts)
    size = len(routing.encode(ids, experts, mode))
    bound = routing_size.max_blob_bytes(tokens, layers, topk, experts, mode)
    floor = tokens * layers * routing_size.floor_bits_per_row(experts, topk, mode) / 8
    assert size <= bound, (size, bound)
    # a bound, not a guess: within 0.1% + 2 words of what the codec wrote
    assert bound <= 1.001 * size + 8 + layers, (size, bound, floor)


def test_trajectory_bound_holds_for_a_serialized_trajectory():
    """A trajectory of uniform routing at Qwen3-30B-A3B's layout, token ids at the int32 varint
    maximum: its serialized size is under max_trajectory_bytes, and near it."""
    prompt, response, layers, topk, experts = 300, 1700, 48, 8, 128
    ids = uniform(prompt + response - 1, layers, topk, experts, seed=1)
    seg = trajectory_pb2.Segment(index=0, token_ids=[2**31 - 1] * response,
                                 logprobs=[-1.5] * response, loss_mask=b"\x01" * response,
                                 policy_version=2**40)
    seg.routing.append(routing_to_proto(ids[:prompt], experts, start_row=0,
                                        layer_ids=list(range(layers))))
    seg.routing.append(routing_to_proto(ids[prompt:], experts, start_row=prompt,
                                        layer_ids=list(range(layers))))
    traj = trajectory_pb2.Trajectory(
        trajectory_id="t" * 64, group_id="g" * 64, group_size=8, prompt_id="p" * 64,
        prompt_token_ids=[2**31 - 1] * prompt, segments=[seg], reward=1.0, worker_id="w" * 64,
        run_id="r" * 36, finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    size = traj.ByteSize()
    bound = routing_size.max_trajectory_bytes(prompt + response, layers, topk, experts)
    assert size <= bound <= 1.01 * size, (size, bound)
    # appended in parts of one chunk (a PulledPart is one of them, or less): the largest is
    # the prompt's chunk with the segment's tokens, within max_part_bytes
    largest = max(r.ByteSize() for r in trajectory_requests(traj, part_bytes=1))
    part_bound = routing_size.max_part_bytes(prompt + response, layers, topk, experts)
    assert seg.routing[1].ByteSize() < largest <= part_bound < bound, (largest, part_bound)


def test_qwen3_30b_figures():
    """The figures the docs quote (DESIGN.md's 242 B/token floor; the bound a little above)."""
    per_token = routing_size.max_bytes_per_token(48, 8, 128)
    assert 242.3 < per_token - routing_size.TOKEN_BYTES < 242.5
    assert routing_size.max_trajectory_bytes(131_072, 48, 8, 128) == pytest.approx(33.08e6,
                                                                                     rel=1e-3)
    assert routing_size.ids_dtype_bytes(256) == 1 and routing_size.ids_dtype_bytes(257) == 2
