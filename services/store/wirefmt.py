"""Protobuf wire-format splicing, so the store moves stored payload bytes without re-parsing.

Protobuf parsers concatenate repeated fields in the order they appear and accept fields in any
order, so a message can be assembled from serialized parts: `Segment` head (fields 1-5) +
`routing` entries, `Trajectory` header + `segments` + finish fields, `PulledGroup` + its
`trajectories`.
"""

from __future__ import annotations

from services.common.pb.r3flow.v1 import trajectory_pb2

SEGMENT_ROUTING = 6       # trajectory.proto: Segment.routing
SEGMENT_SAMPLING = 7      # trajectory.proto: Segment.sampling
TRAJECTORY_SEGMENTS = 5   # trajectory.proto: Trajectory.segments
PULLED_TRAJECTORIES = 3   # store.proto: PulledGroup.trajectories
# store.proto: PulledPart's body fields and its `parts` count (a varint)
PART_GROUP, PART_TRAJECTORY, PART_SEGMENT, PART_ROUTING, PART_COUNT = 1, 2, 3, 4, 5


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def split_prompt_segment(seg: trajectory_pb2.Segment) -> tuple[bytes, int]:
    """(segment bytes without routing[0], length of the head before which routing[0] must be
    spliced back)."""
    head = trajectory_pb2.Segment(index=seg.index, token_ids=seg.token_ids,
                                  logprobs=seg.logprobs, loss_mask=seg.loss_mask,
                                  policy_version=seg.policy_version).SerializeToString()
    tail = b"".join(field(SEGMENT_ROUTING, ch.SerializeToString()) for ch in seg.routing[1:])
    if seg.HasField("sampling"):
        tail += field(SEGMENT_SAMPLING, seg.sampling.SerializeToString())
    return head + tail, len(head)


def join_prompt_segment(payload: bytes, prompt_chunk: bytes, head_len: int) -> bytes:
    """Inverse of `split_prompt_segment`: the prompt chunk becomes routing[0] again."""
    return payload[:head_len] + field(SEGMENT_ROUTING, prompt_chunk) + payload[head_len:]
