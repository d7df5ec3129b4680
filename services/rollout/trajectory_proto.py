"""Domain trajectory (`RolloutState`) -> `Trajectory` wire message, routing encoded by the codec.

Segment 0 sends its prompt rows [0, P) as a chunk of their own, then its response rows, so the
store can keep a GRPO group's prompt rows once (canonical mode makes equal routing byte-equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.common.wire import routing_to_proto
from services.rollout.segments import RolloutState, SegmentRecord, segment_row_ranges

FINISH_REASONS = {
    "stop": trajectory_pb2.FINISH_REASON_STOP,
    "length": trajectory_pb2.FINISH_REASON_LENGTH,
    "abort": trajectory_pb2.FINISH_REASON_ABORTED,
}


@dataclass(frozen=True)
class RoutingLayout:
    """Which engine layers go on the wire and how they are encoded.

    vLLM reports a column for every hidden layer; dense layers' columns are all zero (checked
    before sending) and would fail the codec's distinct-ids rule, so only the MoE layers are
    sent, each chunk naming their engine indices in `layer_ids` for the trainer's layer map.
    """

    num_experts: int
    layer_ids: tuple[int, ...]  # engine hidden-layer index of every column sent (MoE layers)
    mode: str = "canonical"
    chunk_rows: int = 4096  # rows per chunk (RolloutConfig.routing_chunk_rows)

    def chunk(self, rows_TLK: np.ndarray, start_row: int):
        """Encode engine rows [T, all layers, K] as one chunk of the MoE-layer columns."""
        return routing_to_proto(rows_TLK[:, list(self.layer_ids)], self.num_experts,
                                start_row=start_row, layer_ids=self.layer_ids, mode=self.mode)

    def chunks(self, rows_TLK: np.ndarray, start_row: int) -> list:
        """Chunks of at most `chunk_rows` rows: the MoE-column copy is one chunk's at a time."""
        return [self.chunk(rows_TLK[a:a + self.chunk_rows], start_row + a)
                for a in range(0, rows_TLK.shape[0], self.chunk_rows)]


@dataclass(frozen=True)
class TrajectoryMeta:
    trajectory_id: str
    group_id: str
    group_size: int
    prompt_id: str
    worker_id: str
    epoch: int = 0  # the pass over the dataset the prompt came from
    run_id: str = ""  # the training run whose weights sampled it (run fencing)


def segment_to_proto(seg: SegmentRecord, index: int, rows: tuple[int, int], prompt_len: int,
                     layout: RoutingLayout | None) -> trajectory_pb2.Segment:
    """One segment; its rows in chunks of at most `layout.chunk_rows` (segment 0: the prompt
    rows [0, P) first, as one chunk, which the store keeps once per GRPO group)."""
    msg = trajectory_pb2.Segment(
        index=index, token_ids=seg.token_ids, logprobs=seg.logprobs,
        loss_mask=bytes(seg.loss_mask), policy_version=seg.policy_version,
        sampling=trajectory_pb2.SamplingParams(temperature=seg.temperature, top_p=seg.top_p))
    if layout is None or seg.rows_TLK is None:
        return msg
    start, end = rows
    assert seg.rows_TLK.shape[0] == end - start, "segment rows out of step with its tokens"
    cuts = [0, prompt_len, end - start] if index == 0 else [0, end - start]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        if b > a and index == 0 and a == 0:  # the prompt rows stay one chunk: kept once a group
            msg.routing.append(layout.chunk(seg.rows_TLK[a:b], start_row=start))
        elif b > a:
            msg.routing.extend(layout.chunks(seg.rows_TLK[a:b], start_row=start + a))
    return msg


def trajectory_to_proto(meta: TrajectoryMeta, state: RolloutState, *, reward: float,
                        finish_reason: str, layout: RoutingLayout | None,
                        reward_components: dict[str, float] | None = None
                        ) -> trajectory_pb2.Trajectory:
    """The whole trajectory as the store's wire message."""
    lens = [len(s.token_ids) for s in state.segments]
    ranges = segment_row_ranges(len(state.prompt_ids), lens)
    segments = [segment_to_proto(s, j, r, len(state.prompt_ids), layout)
                for j, (s, r) in enumerate(zip(state.segments, ranges, strict=True))]
    return trajectory_pb2.Trajectory(
        trajectory_id=meta.trajectory_id, group_id=meta.group_id, group_size=meta.group_size,
        prompt_token_ids=state.prompt_ids, segments=segments, reward=reward,
        reward_components=reward_components or {}, finish_reason=FINISH_REASONS[finish_reason],
        worker_id=meta.worker_id, prompt_id=meta.prompt_id, epoch=meta.epoch, run_id=meta.run_id)
