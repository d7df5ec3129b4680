"""The weight push's JSON headers: one per bucket (its layout, published before its broadcast)
and the end header (totals and every tensor's checksum, per bucket)."""

from __future__ import annotations

import json

from services.common.weight_sync.buckets import TensorEntry


def encode_header(index: int, nbytes: int, entries: list[TensorEntry]) -> str:
    """The per-bucket header (layout) published before the bucket's broadcast."""
    return json.dumps({"index": index, "nbytes": nbytes,
                       "tensors": [e.to_json() for e in entries]})


def encode_end(num_buckets: int, num_tensors: int, total_bytes: int,
               sums: list[list[int]]) -> str:
    """The header after the last bucket: totals and every tensor's checksum, per bucket."""
    return json.dumps({"end": True, "buckets": num_buckets, "tensors": num_tensors,
                       "bytes": total_bytes, "sums": sums})


def decode_header(blob: str | bytes) -> dict:
    """Parse a header; bucket headers get their entries as `TensorEntry`s."""
    return parse_header(json.loads(blob))


def parse_header(head: dict) -> dict:
    """A header already parsed from JSON; bucket headers get their entries as `TensorEntry`s."""
    if not head.get("end"):
        head["tensors"] = [TensorEntry.from_json(row) for row in head["tensors"]]
    return head
