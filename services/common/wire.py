"""Conversions between numpy routing arrays and the `RoutedExperts` wire message.

Legend: T = rows (token positions), L = layer columns, K = top-k.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from services.common import routing
from services.common.pb.r3flow.v1 import routing_pb2


def routing_to_proto(ids_TLK: np.ndarray, num_experts: int, *, start_row: int,
                     layer_ids: Sequence[int], mode: str = "canonical") -> routing_pb2.RoutedExperts:
    """Encode a [T, L, K] id array as a RoutedExperts chunk starting at trajectory row `start_row`."""
    if len(layer_ids) != ids_TLK.shape[1]:
        raise ValueError(f"layer_ids: {len(layer_ids)} entries for {ids_TLK.shape[1]} layer columns")
    blob = routing.encode(ids_TLK, num_experts, mode=mode)
    return routing_pb2.RoutedExperts(
        shape=list(ids_TLK.shape), num_experts=num_experts, codec=routing_pb2.ROUTING_CODEC_R3C,
        data=blob, start_row=start_row, checksum=zlib.crc32(blob), layer_ids=list(layer_ids))


def routing_from_proto(msg: routing_pb2.RoutedExperts, field: str = "routing") -> np.ndarray:
    """Check and decode one chunk; ValueError names `field` and what is wrong."""
    if msg.codec != routing_pb2.ROUTING_CODEC_R3C:
        raise ValueError(f"{field}.codec: unsupported codec {msg.codec}")
    if len(msg.shape) != 3:
        raise ValueError(f"{field}.shape: expected [rows, layers, topk], got {list(msg.shape)}")
    if zlib.crc32(msg.data) != msg.checksum:
        raise ValueError(f"{field}.checksum: CRC-32 of data does not match")
    if len(msg.layer_ids) != msg.shape[1]:
        raise ValueError(f"{field}.layer_ids: {len(msg.layer_ids)} entries for {msg.shape[1]} layers")
    try:
        ids_TLK = routing.decode(msg.data)
    except ValueError as e:
        raise ValueError(f"{field}.data: {e}") from None
    if list(ids_TLK.shape) != list(msg.shape):
        raise ValueError(f"{field}.shape: says {list(msg.shape)}, data holds {list(ids_TLK.shape)}")
    hdr = routing.peek_header(msg.data)
    if hdr.num_experts != msg.num_experts:
        raise ValueError(f"{field}.num_experts: says {msg.num_experts}, data holds {hdr.num_experts}")
    return ids_TLK
