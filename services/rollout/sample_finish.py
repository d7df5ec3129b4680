"""One finished sample of a group: its routing checks and its wire message, then the engine's
routing arrays dropped (services/rollout/worker.py calls it as each sample ends)."""

from __future__ import annotations

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.rollout.agent import RolloutResult
from services.rollout.engine import RolloutEngine
from services.rollout.segments import RoutingCheckError, check_routing, segment_row_ranges
from services.rollout.trajectory_proto import RoutingLayout, TrajectoryMeta, trajectory_to_proto


def finish_sample(engine: RolloutEngine, layout: RoutingLayout, encode: bool,
                  keep_engine_routing: bool, meta: TrajectoryMeta, res: RolloutResult
                  ) -> trajectory_pb2.Trajectory | None:
    """Routing checks (RoutingCheckError), and the wire message when there is a sink to
    send it to (`encode`; a dry run skips the encoding; the reward is set once scored). The
    engine's routing arrays (392 B per token at Qwen3-30B-A3B's layout) are dropped then: the
    group waits for its other samples holding its routing encoded, not as vLLM returned it."""
    if engine.cfg.capture_routing:
        check_sample(engine, meta.trajectory_id, res)
    traj = None
    if encode:
        layout_or_none = layout if engine.cfg.capture_routing else None
        traj = trajectory_to_proto(meta, res.state, reward=0.0,
                                   finish_reason=res.finish_reason, layout=layout_or_none)
    if not keep_engine_routing:
        for seg in res.state.segments:
            seg.rows_TLK = None
        for call in res.calls:
            call.routing_TLK = None
    return traj


def check_sample(engine: RolloutEngine, trajectory_id: str, res: RolloutResult) -> None:
    """The routing rules on every segment's rows where they lie (no whole-trajectory copy)."""
    state, info = res.state, engine.info
    ranges = segment_row_ranges(len(state.prompt_ids),
                                [len(s.token_ids) for s in state.segments])
    try:
        for seg, (a, b) in zip(state.segments, ranges, strict=True):
            if seg.rows_TLK is None:
                raise RoutingCheckError(f"request {trajectory_id}: no routing captured")
            check_routing(seg.rows_TLK, num_experts=info.num_experts,
                          moe_layers=list(info.moe_layers), expected_rows=b - a,
                          request_id=trajectory_id, dense_layers=info.dense_layers)
    except RoutingCheckError:
        engine.metrics["r3flow_rollout_routing_check_failures_total"].inc()
        raise
