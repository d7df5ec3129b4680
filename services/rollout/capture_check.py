"""The rollout engine's check of its own routing capture, at start and after each weight load
(R3 needs the router's choices of every token, captured as the engine computed them).

Before a worker registers with the store it generates a few tokens of one dataset prompt and
runs the routing checks (services/rollout/segments.py `check_routing`: row count, id range,
distinct ids per row; an all-zero row of a top-k >= 2 layer is the capture-bug signature) on
what the engine captured. An engine whose capture fails them would fail every group while
holding its GPUs, so the worker refuses to serve, with one line naming the engine setting:
on vLLM-CPU, CUDA/CPU graph capture (`engine.enforce_eager: false`) returns all-zero rows.

After each weight load the worker runs the same check again, beside its groups (the groups'
own routing checks keep bad rows out of the store meanwhile); a failure stops the worker the
way a dead engine does: no new prompt, in-flight groups finished or abandoned with accounting,
exit code 3, the same one line naming the setting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from services.rollout.agent import AgentLoop
from services.rollout.engine import EngineDead
from services.rollout.segments import RoutingCheckError, check_routing

CHECK_ID = "routing-capture-check"
CHECK_TOKENS = 8

log = logging.getLogger(__name__)


class RoutingCaptureError(RuntimeError):
    """The engine's routing capture failed the start check; the message names the setting."""


def refusal(enforce_eager: bool, cause: str, when: str = "start check",
            returned: bool = True) -> str:
    """The one line a refusing worker logs; `when`: which check failed; `returned`: whether
    the engine returned routing at all (no routing is never the graphs' fault: measured on
    H200 with vLLM 0.24.0, capture works with CUDA graphs; see docs/rollout.md)."""
    if not returned:
        return (f"routing capture failed its {when} ({cause}): the engine returns no routed "
                f"experts (engine.capture_routing needs vLLM's enable_return_routed_experts, "
                f"engine.enforce_eager: {str(enforce_eager).lower()})")
    if not enforce_eager:
        return (f"routing capture failed its {when} ({cause}): the engine captures no "
                f"valid routing with graphs compiled; set engine.enforce_eager: true "
                f"(rollout.config.engine.enforce_eager in the chart)")
    return (f"routing capture failed its {when} ({cause}) with engine.enforce_eager: true "
            f"already: this engine build does not return routed experts "
            f"(engine.capture_routing needs vLLM's enable_return_routed_experts)")


async def check_capture(engine: Any, sampling: Any, prompt_ids: list[int], seed: int,
                        policy: str = "segment", when: str = "start check",
                        request_id: str = CHECK_ID) -> None:
    """A CHECK_TOKENS generation of `prompt_ids` whose captured routing must pass the routing
    checks; RoutingCaptureError (naming engine.enforce_eager and `when`) when it does not."""
    if not engine.cfg.capture_routing:
        return
    short = sampling.model_copy(update={"max_tokens": CHECK_TOKENS, "max_turns": 1})
    res = await AgentLoop(engine, short, policy=policy).run(request_id, prompt_ids, seed=seed)
    state = res.state
    try:
        rows_TLK = state.all_rows()
        if rows_TLK is None:
            raise RoutingCaptureError(refusal(engine.cfg.enforce_eager,
                                              f"request {request_id}: no routing captured",
                                              when, returned=False))
        check_routing(rows_TLK, num_experts=engine.info.num_experts,
                      moe_layers=list(engine.info.moe_layers),
                      expected_rows=len(state.prompt_ids) + len(state.response_ids) - 1,
                      request_id=request_id, dense_layers=engine.info.dense_layers)
    except RoutingCheckError as e:
        raise RoutingCaptureError(refusal(engine.cfg.enforce_eager, str(e), when)) from None


class AfterLoadCheck:
    """The capture check again after each weight load, on the start check's prompt, as a task
    beside the groups; the first failure's line goes to `on_refusal`."""

    def __init__(self, engine: Any, sampling: Any, seed: int, policy: str,
                 on_refusal: Callable[[str], None]) -> None:
        self.engine, self.sampling, self.seed, self.policy = engine, sampling, seed, policy
        self.on_refusal = on_refusal
        self.probe_ids: list[int] | None = None  # set once the start check passed
        self._tasks: set[asyncio.Task] = set()

    def after_load(self, version: int) -> None:
        """Check the capture of the weights just loaded (`version`), in the background."""
        if self.probe_ids is None or not self.engine.cfg.capture_routing:
            return
        task = asyncio.create_task(self._check(version, self.probe_ids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until the checks started so far are done (tests)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _check(self, version: int, prompt_ids: list[int]) -> None:
        try:
            await check_capture(self.engine, self.sampling, prompt_ids, self.seed, self.policy,
                                when=f"check after loading weights v{version}",
                                request_id=f"{CHECK_ID}-v{version}")
        except RoutingCaptureError as e:
            self.on_refusal(str(e))
        except EngineDead:
            pass  # the worker's engine watch stops it, naming the cause
        except ValueError as e:  # the probe prompt no longer fits (not the capture's fault)
            log.warning("routing capture check after loading v%d skipped: %s", version, e)
        except Exception as e:  # a bug: the weights just loaded must not serve unchecked
            log.exception("routing capture check after loading v%d failed", version)
            self.on_refusal(f"{type(e).__name__} in the routing capture check after loading "
                            f"v{version}: {e}")
        else:
            log.info("routing capture check after loading v%d passed", version)
