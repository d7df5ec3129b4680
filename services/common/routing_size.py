"""Worst-case sizes of routing and trajectories, for sizing Redis, pods and messages (issue 54).

Pure arithmetic (no codec library): `r3flow plan` and the chart's render checks
(helm/r3flow/templates/_sizing.tpl mirrors `max_trajectory_bytes`; tests/chart/test_sizing.py
keeps them equal) size for these, never for the information floor or a measured mean:
  * a routing blob (services/common/routing.py) of T rows x L layers costs at most the floor
    log2 C(E, K) bits per row (log2 E!/(E-K)! in exact mode) x (1 + CODEC_MARGIN), one method
    bit per layer per block of 65,536 rows, and 68 fixed bytes (32 header, 32 rANS states, the
    last word's rounding); any input, uniform routing the worst (tests/unit/test_routing_size.py
    encodes it);
  * a trajectory on the wire and in Redis: per token its routing at that bound plus
    TOKEN_BYTES (the token id as a varint, its logprob, its loss-mask byte); per routing chunk
    CHUNK_BYTES(L) (codec overhead, method bits of up to 8 blocks, RoutedExperts fields and
    layer ids); TRAJECTORY_BYTES for ids, names, reward and segment heads.
Qwen3-30B-A3B (48 MoE layers, top-8 of 128): 242.3 B per token of routing, 252.4 with the
token's other fields; a 131,072-token trajectory 33.1 MB, a group of 8 of them 264.7 MB.
Legend: T rows (tokens), L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import math

# encode()'s payload over the floor, measured <= 1.1e-4 on uniform routing (up to 131,072 rows,
# 2-1,024 experts, both modes); the bound allows 5x that
CODEC_MARGIN = 5e-4
BLOB_FIXED = 68  # header 32 + four 64-bit rANS states 32 + the last 32-bit word's rounding 4
BLOCK_ROWS = 65_536  # rows per codec block: each costs one method bit per layer
TOKEN_BYTES = 10  # token id varint (<= 5), logprob (4), loss mask (1)
TRAJECTORY_BYTES = 1024  # ids, names, reward, finish, segment heads (index, version, sampling)


def ids_dtype_bytes(num_experts: int) -> int:
    """Bytes of one decoded id: the codec's uint8 up to 256 experts, else uint16."""
    return 1 if num_experts <= 256 else 2


def floor_bits_per_row(num_experts: int, topk: int, mode: str = "canonical") -> float:
    """Information floor of one row: log2 C(E, K) bits (canonical) or log2 E!/(E-K)! (exact)."""
    n = math.comb(num_experts, topk) if mode == "canonical" else math.perm(num_experts, topk)
    return math.log2(n)


def max_blob_bytes(tokens: int, layers: int, topk: int, num_experts: int,
                   mode: str = "canonical") -> int:
    """Largest blob routing.encode returns for any ids of shape [T, L, K] (module docstring)."""
    bits = tokens * layers * floor_bits_per_row(num_experts, topk, mode) * (1 + CODEC_MARGIN)
    bits += layers * -(-tokens // BLOCK_ROWS) if tokens >= 64 else 0
    return BLOB_FIXED + 4 * math.ceil(bits / 32)


def chunk_bytes(layers: int) -> int:
    """Fixed bytes of one RoutedExperts chunk on the wire besides its rows' bits: codec header,
    states and rounding (68 + 4), method bits of up to 8 blocks (L), the message's fields and
    its Segment field head (< 56) and its layer ids (<= 2 B each)."""
    return 128 + 3 * layers


def max_bytes_per_token(layers: int, topk: int, num_experts: int) -> float:
    """Worst-case bytes of one token of a trajectory: its routing (canonical) + TOKEN_BYTES."""
    return layers * floor_bits_per_row(num_experts, topk) * (1 + CODEC_MARGIN) / 8 + TOKEN_BYTES


def max_trajectory_bytes(tokens: int, layers: int, topk: int, num_experts: int,
                         chunks: int = 2) -> int:
    """Worst-case serialized Trajectory of `tokens` (prompt + response) whose routing is sent
    in `chunks` chunks (2: the prompt's and the response's; every further segment or streamed
    chunk adds one)."""
    per_token = max_bytes_per_token(layers, topk, num_experts)
    return math.ceil(tokens * per_token) + chunks * chunk_bytes(layers) + TRAJECTORY_BYTES
