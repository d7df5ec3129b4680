"""The rollout engine's start check of its own routing capture (R3 needs the router's choices
of every token, captured as the engine computed them).

Before a worker registers with the store it generates a few tokens of one dataset prompt and
runs the routing checks (services/rollout/segments.py `check_routing`: row count, id range,
distinct ids per row; an all-zero row of a top-k >= 2 layer is the capture-bug signature) on
what the engine captured. An engine whose capture fails them would fail every group while
holding its GPUs, so the worker refuses to serve, with one line naming the engine setting:
on vLLM-CPU, CUDA/CPU graph capture (`engine.enforce_eager: false`) returns all-zero rows.
"""

from __future__ import annotations

from typing import Any

from services.rollout.agent import AgentLoop
from services.rollout.segments import RoutingCheckError, check_routing

CHECK_ID = "routing-capture-check"
CHECK_TOKENS = 8


class RoutingCaptureError(RuntimeError):
    """The engine's routing capture failed the start check; the message names the setting."""


def refusal(enforce_eager: bool, cause: str) -> str:
    """The one line a refusing worker logs."""
    if not enforce_eager:
        return (f"routing capture failed its start check ({cause}): the engine captures no "
                f"valid routing with graphs compiled; set engine.enforce_eager: true "
                f"(rollout.config.engine.enforce_eager in the chart)")
    return (f"routing capture failed its start check ({cause}) with engine.enforce_eager: true "
            f"already: this engine build does not return routed experts "
            f"(engine.capture_routing needs vLLM's enable_return_routed_experts)")


async def check_capture(engine: Any, sampling: Any, prompt_ids: list[int], seed: int,
                        policy: str = "segment") -> None:
    """A CHECK_TOKENS generation of `prompt_ids` whose captured routing must pass the routing
    checks; RoutingCaptureError (naming engine.enforce_eager) when it does not."""
    if not engine.cfg.capture_routing:
        return
    short = sampling.model_copy(update={"max_tokens": CHECK_TOKENS, "max_turns": 1})
    res = await AgentLoop(engine, short, policy=policy).run(CHECK_ID, prompt_ids, seed=seed)
    state = res.state
    try:
        rows_TLK = state.all_rows()
        if rows_TLK is None:
            raise RoutingCheckError(f"request {CHECK_ID}: no routing captured")
        check_routing(rows_TLK, num_experts=engine.info.num_experts,
                      moe_layers=list(engine.info.moe_layers),
                      expected_rows=len(state.prompt_ids) + len(state.response_ids) - 1,
                      request_id=CHECK_ID, dense_layers=engine.info.dense_layers)
    except RoutingCheckError as e:
        raise RoutingCaptureError(refusal(engine.cfg.enforce_eager, str(e))) from None
