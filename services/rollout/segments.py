"""Segment and routing-row bookkeeping of one trajectory (pure, no engine).

Legend: T = routing rows (token positions), L = engine hidden layers (dense ones included),
K = top-k. A trajectory with P prompt and R response tokens has P + R - 1 rows; segment 0 owns
rows [0, P + n_0 - 1), segment j > 0 owns [P + n_0 + ... + n_{j-1} - 1, ... + n_j).

Every engine call continues the trajectory from its current context (prompt + all segment
tokens + environment tokens still pending). A call that produced tokens closes one segment:
pending environment tokens (loss-masked, logprob 0) followed by the generated tokens. Under the
`segment` policy the call asks only for the rows it owns (`routed_experts_prompt_start`); under
`replace` it asks for every row and its routing overwrites the earlier segments' rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.routing_rules import RoutingRuleError, RoutingSpec, check_ids


class RoutingCheckError(ValueError):
    """Captured routing failed a sanity check; the message names the request."""


@dataclass
class SegmentRecord:
    """Tokens one engine call appended, under one policy version."""

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    policy_version: int
    rows_TLK: np.ndarray | None = None  # None when routing capture is off
    temperature: float = 1.0  # sampling of the call: the logprobs are of this distribution
    top_p: float = 1.0


@dataclass
class CallOutput:
    """What one engine call returned (rows start at the requested prompt start)."""

    token_ids: list[int]
    logprobs: list[float]
    routing_TLK: np.ndarray | None
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int
    request_id: str
    temperature: float = 1.0
    top_p: float = 1.0


def segment_row_ranges(prompt_len: int, seg_lens: list[int]) -> list[tuple[int, int]]:
    """[start, end) routing rows of every segment under the wire convention."""
    if prompt_len < 1:
        raise ValueError("prompt_len: must be >= 1")
    ranges, end = [], prompt_len - 1
    for j, n in enumerate(seg_lens):
        start = 0 if j == 0 else end
        end = end + n
        ranges.append((start, end))
    return ranges


def split_rows(full_TLK: np.ndarray, prompt_len: int, seg_lens: list[int]) -> list[np.ndarray]:
    """Slice whole-trajectory rows into per-segment rows."""
    expected = prompt_len + sum(seg_lens) - 1
    if full_TLK.shape[0] != expected:
        raise ValueError(f"routing rows: got {full_TLK.shape[0]}, expected {expected}")
    return [full_TLK[a:b] for a, b in segment_row_ranges(prompt_len, seg_lens)]


@dataclass
class RolloutState:
    """Token, logprob, mask, version and routing bookkeeping of one trajectory."""

    prompt_ids: list[int]
    policy: str = "segment"  # "segment" | "replace"
    segments: list[SegmentRecord] = field(default_factory=list)
    pending_env: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_token_ids: empty prompt")
        if self.policy not in ("segment", "replace"):
            raise ValueError(f"partial_rollout_policy: unknown policy {self.policy!r}")

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def context_ids(self) -> list[int]:
        """The next call's prompt: prompt + every segment's tokens + pending env tokens."""
        return self.prompt_ids + self.response_ids + self.pending_env

    def known_rows(self) -> int:
        """Rows already held: every position but the last closed token's."""
        return 0 if not self.segments else len(self.prompt_ids) + len(self.response_ids) - 1

    def request_start_row(self) -> int:
        """`routed_experts_prompt_start` of the next call."""
        return 0 if self.policy == "replace" else self.known_rows()

    def add_env_tokens(self, env_ids: list[int]) -> None:
        """Queue environment tokens; they open the next segment, loss-masked."""
        if not self.segments:
            raise ValueError("environment tokens: only allowed after a generated turn")
        self.pending_env = self.pending_env + list(env_ids)

    def close_call(self, call: CallOutput) -> SegmentRecord | None:
        """Append the call's tokens as a new segment; None when it produced nothing."""
        if not call.token_ids:
            return None  # aborted before its first token: the next call redoes it
        if len(call.logprobs) != len(call.token_ids):
            raise ValueError(f"request {call.request_id}: {len(call.logprobs)} logprobs for "
                             f"{len(call.token_ids)} tokens")
        env, n_env = self.pending_env, len(self.pending_env)
        seg = SegmentRecord(
            token_ids=env + list(call.token_ids), logprobs=[0.0] * n_env + list(call.logprobs),
            loss_mask=[0] * n_env + [1] * len(call.token_ids), policy_version=call.policy_version,
            temperature=call.temperature, top_p=call.top_p)
        start = self.request_start_row()
        self.segments.append(seg)
        self.pending_env = []
        if call.routing_TLK is not None:
            self._take_rows(call.routing_TLK, start, call.request_id)
        return seg

    def _take_rows(self, rows_TLK: np.ndarray, start: int, request_id: str) -> None:
        lens = [len(s.token_ids) for s in self.segments]
        ranges = segment_row_ranges(len(self.prompt_ids), lens)
        end = ranges[-1][1]
        if rows_TLK.shape[0] != end - start:
            raise RoutingCheckError(
                f"request {request_id}: engine returned {rows_TLK.shape[0]} routing rows for "
                f"rows [{start}, {end}) ({end - start} expected)")
        for seg, (a, b) in zip(self.segments, ranges, strict=True):
            if a >= start:  # rows this call owns (all of them under `replace`)
                seg.rows_TLK = rows_TLK[a - start:b - start]

    def all_rows(self) -> np.ndarray | None:
        """Every routing row of the trajectory in order, or None when not captured."""
        parts = [s.rows_TLK for s in self.segments if s.rows_TLK is not None]
        if not parts or len(parts) != len(self.segments):
            return None
        return np.concatenate(parts, axis=0)


def check_routing(ids_TLK: np.ndarray, *, num_experts: int, moe_layers: list[int],
                  expected_rows: int, request_id: str, dense_layers: tuple[int, ...] = ()
                  ) -> None:
    """The routing rules of services/common/routing_rules.py on an engine view (every hidden
    layer): row count, id range, distinct ids per row (an all-zero row of a top-k >= 2 layer is
    the capture-bug signature), dense layers all zero (a non-zero dense column means the layer
    map is off). With top-1 nothing about zeros is wrong: every token may go to expert 0."""
    spec = RoutingSpec(num_experts, rows=expected_rows, moe_columns=tuple(moe_layers),
                       dense_columns=tuple(dense_layers))
    try:
        check_ids(ids_TLK, spec)
    except RoutingRuleError as e:
        raise RoutingCheckError(f"request {request_id}: {e}") from None
