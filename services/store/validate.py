"""Validation of append messages against a trajectory's stored state, before anything is written.

Each `validate_*` function checks one message and returns the write it implies; `advance`
applies that write to the in-memory state so a whole Append stream can be checked before its
first message is committed. Errors are ValueError whose message starts with the field name.

Row convention (proto/r3flow/v1/trajectory.proto): a trajectory with P prompt tokens and
segments of n_0, n_1, ... tokens has P + sum(n) - 1 routing rows; segment 0 covers rows
[0, P + n_0 - 1), segment j > 0 covers the next n_j rows. A segment sent in parts
(AppendRequest.part / more_parts) stays open until its parts' chunks cover its rows.

Legend: T = routing rows, L = layer columns, K = top-k.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Container
from dataclasses import dataclass, field

from services.common import routing_rules
from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store import wirefmt
from services.store.routing_checks import RoutingChecks, Walk, check_chunk

MAX_ID_CHARS = 256


@dataclass(frozen=True)
class Layout:
    """Routing layout that every chunk of one trajectory must share."""

    layers: int
    topk: int
    num_experts: int
    layer_ids: tuple[int, ...]

    def encode(self) -> str:
        return f"{self.layers}/{self.topk}/{self.num_experts}/" + ",".join(map(str, self.layer_ids))

    @staticmethod
    def decode(text: str) -> Layout:
        layers, topk, num_experts, ids = text.split("/")
        layer_ids = tuple(int(x) for x in ids.split(",")) if ids else ()
        return Layout(int(layers), int(topk), int(num_experts), layer_ids)

    def spec(self) -> routing_rules.RoutingSpec:
        """The routing rules' view: what every later chunk of the trajectory must match."""
        return routing_rules.RoutingSpec(self.num_experts, top_k=self.topk,
                                         layer_ids=self.layer_ids, layers=self.layers)


@dataclass
class TrajState:
    """What validation needs to know about a stored (or simulated) trajectory."""

    next_seq: int = 0           # sequence number the store expects next (0 = not begun)
    done: bool = False          # complete, acked or dropped: every message is a duplicate
    prompt_len: int = 0
    rows: int = 0               # routing rows stored so far = start_row of the next segment
    tokens: int = 0             # prompt + response tokens stored so far
    num_segments: int = 0
    layout: Layout | None = None
    group_id: str = ""
    part: int = 0               # next part of the open segment (0 = no segment open)
    open_rows: int = 0          # rows the open segment still lacks


@dataclass
class GroupState:
    """What a begin needs to know about its GRPO group."""

    size: int = 0               # 0 = group not created yet
    members: int = 0
    closed: bool = False        # released and acked, or dropped
    stored_prompts: set[str] = field(default_factory=set)     # prompt fields in Redis
    validated_prompts: set[str] = field(default_factory=set)  # ... plus ones seen this stream


@dataclass(frozen=True)
class Limits:
    max_tokens_per_trajectory: int
    max_group_size: int
    decode_routing: bool = True  # False: header + CRC checks only (see StoreConfig)
    # (name, num_experts, top_k) of the registered models; empty = any routing layout
    models: tuple[tuple[str, int, int], ...] = ()


@dataclass
class BeginWrite:
    trajectory_id: str
    group_id: str
    group_size: int
    prompt_len: int
    header: bytes               # serialized Trajectory without segments or finish fields
    seq: int = 0


@dataclass
class SegmentWrite:
    trajectory_id: str
    group_id: str
    seq: int
    start_row: int
    rows: int
    tokens: int
    policy_version: int
    layout: Layout
    head: bytes                 # serialized Segment without routing (b"" on parts > 0)
    chunks: list[bytes]         # serialized routing chunks, minus the deduplicated prompt chunk
    prompt_field: str = ""      # group hash field of the prompt chunk ("" = none)
    prompt_chunk: bytes = b""
    raw_bytes: int = 0          # routing as uint8 ids
    encoded_bytes: int = 0      # routing data bytes in `chunks`
    part: int = 0               # AppendRequest.part
    open_rows: int = 0          # rows the segment still lacks after this part (more_parts)

    @property
    def payload(self) -> bytes:
        """The part as one serialized Segment (head + stored chunks)."""
        return self.head + b"".join(wirefmt.field(wirefmt.SEGMENT_ROUTING, c)
                                    for c in self.chunks)


@dataclass
class FinishWrite:
    trajectory_id: str
    group_id: str
    seq: int
    num_segments: int
    aborted: bool
    payload: bytes              # serialized TrajectoryFinish


Write = BeginWrite | SegmentWrite | FinishWrite


def check_envelope(req: store_pb2.AppendRequest) -> str:
    """Check id and body/sequence-number agreement; returns the body kind."""
    tid = req.trajectory_id
    if not tid or len(tid) > MAX_ID_CHARS:
        raise ValueError(f"trajectory_id: must be 1..{MAX_ID_CHARS} characters, got {len(tid)}")
    kind = req.WhichOneof("body")
    if kind is None:
        raise ValueError("body: one of begin, segment, finish is required")
    if (kind == "begin") != (req.sequence_number == 0):
        raise ValueError(f"sequence_number: {req.sequence_number} cannot carry {kind} "
                         "(0 = begin, 1..n = segments, n+1 = finish)")
    if kind != "segment" and (req.part or req.more_parts):
        raise ValueError(f"part: only a segment may be sent in parts, not a {kind}")
    return kind


def check_order(req: store_pb2.AppendRequest, state: TrajState) -> bool:
    """True if the message is new; False for a duplicate; ValueError on a gap."""
    if state.done or req.sequence_number < state.next_seq:
        return False
    if req.sequence_number > state.next_seq:
        open_part = f" (segment {state.next_seq - 1} still awaits part {state.part})" \
            if state.part else ""
        raise ValueError(f"sequence_number: got {req.sequence_number}, expected "
                         f"{state.next_seq} (messages 0..{req.sequence_number - 1} not stored)"
                         + open_part)
    if req.part < state.part:
        if req.WhichOneof("body") != "segment":
            raise ValueError(f"sequence_number: {req.sequence_number} is segment "
                             f"{req.sequence_number - 1}, still open (awaits part {state.part})")
        return False
    if req.part > state.part:
        raise ValueError(f"part: got {req.part}, expected {state.part} (segment "
                         f"{req.sequence_number - 1}'s parts 0..{req.part - 1} not stored)")
    return True


def validate_begin(req: store_pb2.AppendRequest, group: GroupState, limits: Limits) -> BeginWrite:
    """Check a begin message against its group and the limits."""
    b = req.begin
    if not b.group_id or len(b.group_id) > MAX_ID_CHARS:
        raise ValueError(f"begin.group_id: must be 1..{MAX_ID_CHARS} characters")
    if not 1 <= b.group_size <= limits.max_group_size:
        raise ValueError(f"begin.group_size: {b.group_size} not in 1..{limits.max_group_size} "
                         "(max_group_size)")
    if group.closed:
        raise ValueError(f"begin.group_id: group {b.group_id!r} was already released or dropped")
    if group.size and group.size != b.group_size:
        raise ValueError(f"begin.group_size: {b.group_size}, but group {b.group_id!r} "
                         f"has size {group.size}")
    if group.size and group.members >= group.size:
        raise ValueError(f"begin.group_id: group {b.group_id!r} already has {group.members} "
                         "trajectories")
    if len(b.run_id) > MAX_ID_CHARS:
        raise ValueError(f"begin.run_id: over {MAX_ID_CHARS} characters")
    _check_prompt(b.prompt_token_ids, limits)
    header = trajectory_pb2.Trajectory(
        trajectory_id=req.trajectory_id, group_id=b.group_id, group_size=b.group_size,
        prompt_token_ids=b.prompt_token_ids, worker_id=b.worker_id, prompt_id=b.prompt_id,
        epoch=b.epoch, run_id=b.run_id)
    return BeginWrite(req.trajectory_id, b.group_id, b.group_size, len(b.prompt_token_ids),
                      header.SerializeToString())


def _check_prompt(prompt_token_ids: object, limits: Limits) -> None:
    n = len(prompt_token_ids)  # type: ignore[arg-type]
    if n == 0:
        raise ValueError("begin.prompt_token_ids: empty prompt")
    if n >= limits.max_tokens_per_trajectory:
        raise ValueError(f"begin.prompt_token_ids: {n} tokens leave no room under "
                         f"max_tokens_per_trajectory={limits.max_tokens_per_trajectory}")
    if min(prompt_token_ids) < 0:  # type: ignore[call-overload]
        raise ValueError("begin.prompt_token_ids: negative token id")


def validate_segment(req: store_pb2.AppendRequest, state: TrajState, limits: Limits,
                     known_prompts: Container[str] = frozenset(),
                     pending: RoutingChecks | None = None) -> SegmentWrite:
    """Check a segment's tokens, per-token fields and routing rows against the trajectory.

    `known_prompts`: group prompt-chunk fields already validated; a chunk with the same content
    hash is not checked again (in a GRPO group n-1 of n prompt chunks are such repeats).
    `pending`: where routing payload walks go (the caller runs them before committing);
    None walks each payload here.
    """
    seg, j = req.segment, req.sequence_number - 1
    if seg.index != j:
        raise ValueError(f"segment.index: {seg.index}, but sequence_number "
                         f"{req.sequence_number} carries segment {j}")
    if req.part:
        return _segment_part(req, state, Walk(limits.decode_routing, pending, req, limits.models))
    n = _check_tokens(seg)
    if state.tokens + n > limits.max_tokens_per_trajectory:
        raise ValueError(f"segment.token_ids: trajectory would have {state.tokens + n} tokens > "
                         f"max_tokens_per_trajectory={limits.max_tokens_per_trajectory}")
    if seg.policy_version < 0:
        raise ValueError(f"segment.policy_version: {seg.policy_version} < 0")
    expected = routing_rules.expected_rows(state.prompt_len, n) if j == 0 else n
    prompt_chunk, prompt_field = _prompt_chunk(seg, state)
    walk = Walk(limits.decode_routing, pending, req, limits.models)
    chunks = _check_routing(seg, state, walk, trust_first=prompt_field in known_prompts)
    _check_rows(req, chunks.rows, expected)
    return _segment_write(req, state, chunks, n, prompt_chunk, prompt_field, expected)


def _segment_part(req: store_pb2.AppendRequest, state: TrajState, walk: Walk) -> SegmentWrite:
    """A later part of a segment sent in parts: routing chunks only, continuing its rows."""
    seg = req.segment
    for name in ("token_ids", "logprobs", "loss_mask"):
        if len(getattr(seg, name)):
            raise ValueError(f"segment.{name}: part {req.part} may carry routing chunks only "
                             "(tokens go in part 0)")
    chunks = _check_routing(seg, state, walk)
    _check_rows(req, chunks.rows, state.open_rows)
    return _segment_write(req, state, chunks, 0, b"", "", state.open_rows)


def _check_rows(req: store_pb2.AppendRequest, got: int, expected: int) -> None:
    """A part with more_parts leaves rows for later parts; the last part completes them."""
    if got == expected and not req.more_parts:
        return
    if req.more_parts and got < expected:
        return
    want = f"fewer than {expected} (more_parts)" if req.more_parts else str(expected)
    where = f" in part {req.part}" if req.part or req.more_parts else ""
    raise ValueError(
        f"segment.routing: {got} rows{where}, expected {want} (a trajectory with P prompt and "
        "R response tokens has P+R-1 rows: segment 0 carries P+n0-1, later segments n_j)")


def _segment_write(req: store_pb2.AppendRequest, state: TrajState, chunks: _Chunks, n: int,
                   prompt_chunk: bytes, prompt_field: str, expected: int) -> SegmentWrite:
    seg = req.segment
    write = SegmentWrite(req.trajectory_id, state.group_id, req.sequence_number, state.rows,
                         chunks.rows, n, seg.policy_version, chunks.layout, b"", [],
                         raw_bytes=chunks.raw_bytes, encoded_bytes=chunks.encoded_bytes,
                         part=req.part, open_rows=expected - chunks.rows)
    if not req.part:
        head = trajectory_pb2.Segment(index=seg.index, token_ids=seg.token_ids,
                                      logprobs=seg.logprobs, loss_mask=seg.loss_mask,
                                      policy_version=seg.policy_version)
        if seg.HasField("sampling"):
            head.sampling.CopyFrom(seg.sampling)
        write.head = head.SerializeToString()
    routing = list(seg.routing)
    if prompt_field:
        write.prompt_chunk, write.prompt_field = prompt_chunk, prompt_field
        write.encoded_bytes -= len(routing[0].data)
        routing = routing[1:]
    write.chunks = [c.SerializeToString() for c in routing]
    return write


def _prompt_chunk(seg: trajectory_pb2.Segment, state: TrajState) -> tuple[bytes, str]:
    """(serialized chunk, group hash field) of segment 0's prompt rows [0, P), if sent apart.

    The prompt rows are identical across a GRPO group unless routing had near-ties, so they
    are keyed by content: equal chunks share one copy, a differing one gets its own.
    """
    if seg.index != 0 or not seg.routing:
        return b"", ""
    first = seg.routing[0]
    if first.start_row != 0 or not first.shape or first.shape[0] != state.prompt_len:
        return b"", ""
    blob = first.SerializeToString(deterministic=True)
    return blob, "p:" + hashlib.sha256(blob).hexdigest()[:40]


def _check_tokens(seg: trajectory_pb2.Segment) -> int:
    n = len(seg.token_ids)
    if n == 0:
        raise ValueError("segment.token_ids: empty segment")
    if min(seg.token_ids) < 0:
        raise ValueError("segment.token_ids: negative token id")
    if len(seg.logprobs) != n:
        raise ValueError(f"segment.logprobs: {len(seg.logprobs)} values for {n} tokens")
    # A float32 sum cannot overflow float64, so it is finite iff every value is.
    if not math.isfinite(sum(seg.logprobs)):
        raise ValueError("segment.logprobs: NaN or infinite value")
    if len(seg.loss_mask) != n:
        raise ValueError(f"segment.loss_mask: {len(seg.loss_mask)} bytes for {n} tokens")
    if seg.loss_mask.strip(b"\x00\x01"):
        raise ValueError("segment.loss_mask: bytes must be 0 or 1")
    return n


@dataclass
class _Chunks:
    layout: Layout
    rows: int
    raw_bytes: int
    encoded_bytes: int = 0


def _check_routing(seg: trajectory_pb2.Segment, state: TrajState, walk: Walk,
                   trust_first: bool = False) -> _Chunks:
    """Every chunk's header, payload (to `walk`), row continuity and layout; the row count is
    the caller's to check."""
    if not seg.routing:
        raise ValueError(f"segment.routing: missing; rows from {state.rows} on are required")
    layout, row, raw = state.layout, state.rows, 0
    for c, chunk in enumerate(seg.routing):
        name = f"segment.routing[{c}]"
        if c == 0 and trust_first:  # byte-identical to a chunk that passed these checks
            rows, size = chunk.shape[0], chunk.shape[0] * chunk.shape[1] * chunk.shape[2]
        else:
            rows, size = check_chunk(chunk, name, walk)
        if chunk.start_row != row:
            raise ValueError(f"{name}.start_row: {chunk.start_row}, expected {row} "
                             "(chunks must continue the trajectory's rows without gaps)")
        if rows == 0:
            raise ValueError(f"{name}.shape: chunk has no rows")
        layout = _check_layout(chunk, layout, name)
        _check_registered(layout, walk.models, name)
        row += rows
        raw += size
    assert layout is not None
    return _Chunks(layout, row - state.rows, raw, sum(len(ch.data) for ch in seg.routing))


# RoutingRuleError.field -> (proto field, Layout attribute)
_LAYOUT_FIELDS = {"layers": ("shape[1]", "layers"), "top_k": ("shape[2]", "topk"),
                  "num_experts": ("num_experts", "num_experts"),
                  "layer_ids": ("layer_ids", "layer_ids")}


def _check_layout(chunk: object, layout: Layout | None, name: str) -> Layout:
    here = Layout(chunk.shape[1], chunk.shape[2], chunk.num_experts,  # type: ignore[attr-defined]
                  tuple(chunk.layer_ids))  # type: ignore[attr-defined]
    if layout is None:
        return here
    try:
        routing_rules.check_layout(layout.spec(), layers=here.layers, top_k=here.topk,
                                   num_experts=here.num_experts, layer_ids=here.layer_ids)
    except routing_rules.RoutingRuleError as e:
        label, attr = _LAYOUT_FIELDS[e.field]
        raise ValueError(f"{name}.{label}: {getattr(here, attr)}, but the trajectory has "
                         f"{getattr(layout, attr)} ({attr} must not change)") from None
    return layout


def _fits(spec: routing_rules.RoutingSpec, layout: Layout) -> bool:
    try:
        routing_rules.check_layout(spec, layers=layout.layers, top_k=layout.topk,
                                   num_experts=layout.num_experts)
    except routing_rules.RoutingRuleError:
        return False
    return True


def _check_registered(layout: Layout, models: tuple[tuple[str, int, int], ...],
                      name: str) -> None:
    """A chunk's experts and top-k must be those of a registered model: a rollout with another
    `num_experts_per_tok` would otherwise train with K' experts per token, silently."""
    if not models or any(_fits(routing_rules.RoutingSpec(e, top_k=k), layout)
                         for _, e, k in models):
        return
    known = ", ".join(f"{n} (num_experts={e}, top_k={k})" for n, e, k in models)
    raise ValueError(f"{name}.num_experts/shape[2]: routing has num_experts={layout.num_experts}"
                     f", top_k={layout.topk}; registered models: {known}")


def validate_finish(req: store_pb2.AppendRequest, state: TrajState) -> FinishWrite:
    """Check the closing message: segment count, reward values, finish reason."""
    f = req.finish
    if state.num_segments == 0:
        raise ValueError("finish.num_segments: trajectory has no segments")
    if f.num_segments != state.num_segments:
        raise ValueError(f"finish.num_segments: {f.num_segments}, but {state.num_segments} "
                         "segments were stored")
    if not math.isfinite(f.reward):
        raise ValueError("finish.reward: NaN or infinite")
    for key, value in f.reward_components.items():
        if not math.isfinite(value):
            raise ValueError(f"finish.reward_components[{key!r}]: NaN or infinite")
    if f.finish_reason not in trajectory_pb2.FinishReason.values():
        raise ValueError(f"finish.finish_reason: unknown value {f.finish_reason}")
    aborted = f.finish_reason == trajectory_pb2.FINISH_REASON_ABORTED
    return FinishWrite(req.trajectory_id, state.group_id, req.sequence_number, f.num_segments,
                       aborted, f.SerializeToString(deterministic=True))


def advance(state: TrajState, write: Write) -> None:
    """Apply a validated write to the in-memory state (so the next message sees it)."""
    state.next_seq = write.seq + 1
    if isinstance(write, BeginWrite):
        state.prompt_len = state.tokens = write.prompt_len
        state.group_id = write.group_id
    elif isinstance(write, SegmentWrite):
        state.rows += write.rows
        state.tokens += write.tokens
        state.num_segments += write.part == 0
        state.layout = write.layout
        state.open_rows = write.open_rows
        state.part = write.part + 1 if write.open_rows else 0
        if write.open_rows:
            state.next_seq = write.seq  # the segment stays open for its next part
    else:
        state.done = True
